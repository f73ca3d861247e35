"""A job's output directory: where each file lives, and reading and writing them.

    OUTPUT/results/<shard_id>.parquet   one part per shard (or .jsonl), written atomically
    OUTPUT/shard_stats/<shard_id>.json  timings of that shard (device-seconds, latencies)
    OUTPUT/ledger.json                  the job's ledger
    OUTPUT/results.jsonl                OpenAI batch output (with output_format="openai-batch")
    OUTPUT/ledger/                      the default ledger dataset (one Parquet file per job)
    OUTPUT/_plan/<shard_id>.parquet     a shard's planned rows (`spill`); removed when the
                                        job finishes
    OUTPUT/_windows/<w>-<row>.parquet   a planning window's tokenized rows from row <row>,
                                        in input order, staged by planning spread over
                                        workers (`spread_planning`); and the parts' ids in
    OUTPUT/_windows/ids-<b>/<part>-<n>.parquet  hash buckets (`id_buckets`); all removed
                                        when planning ends
    OUTPUT/_input.json                  the input's fingerprint (files, sizes, versions): a
                                        resumed run refuses an input that changed
    OUTPUT/_forecast.json               a dry run's forecast (`pipelines/forecast.py`); the
                                        job's ledger shows it beside the actuals
    OUTPUT/_cut.json                    how the job's shards were cut ({"min_shards": N,
                                        "rule": R}), so a resume on another number of
                                        workers, or by a newer version, cuts the same
    OUTPUT/_progress/<shard_id>.json    a running flow shard's progress (`flows/progress.py`);
                                        removed when the job finishes
    OUTPUT/_lock.json                   the lock of the run writing here (`output_lock`)

A shard is complete iff its part exists: the stats file is written first, so a part
never lacks its stats, and a shard killed before its part is published is simply
rerun (its stats file is overwritten). All writes go through the connectors' atomic
writers, on local disk and object stores alike.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tokenmill.connectors import (
    lines_writer,
    list_parts,
    read_json,
    read_part,
    read_parts,
    write_json_atomic,
    write_part,
)
from tokenmill.connectors.atomic import is_temp_name
from tokenmill.connectors.fs import display, is_local, resolve
from tokenmill.connectors.store_retries import store_operation
from tokenmill.pipelines.ledger import JobLedger, ShardStats
from tokenmill.pipelines.results import RESULT_SCHEMA
from tokenmill.pipelines.scoring import GENERATE

RESULTS_DIR = "results"
STATS_DIR = "shard_stats"
PLAN_DIR = "_plan"  # "_": hidden from anyone reading OUTPUT as a dataset
WINDOWS_DIR = "_windows"
INPUT_FILE = "_input.json"
FORECAST_FILE = "_forecast.json"
CUT_FILE = "_cut.json"
# How many times the staged windows' removal is tried while a late part still writes.
STAGING_REMOVALS = 5
PROGRESS_DIR = "_progress"
LEDGER_FILE = "ledger.json"
OPENAI_RESULTS_FILE = "results.jsonl"
DEFAULT_LEDGER_DIR = "ledger"

StorageOptions = Mapping[str, Any] | None


def join(base: str, *names: str) -> str:
    """`base/names...` for local paths and URLs alike."""
    return posixpath.join(base.rstrip("/"), *names)


def results_uri(output: str) -> str:
    return join(output, RESULTS_DIR)


def default_ledger_dataset(output: str) -> str:
    return join(output, DEFAULT_LEDGER_DIR)


def part_shard_id(part_url: str) -> str:
    """The shard id a part file is named by."""
    name = posixpath.basename(part_url.rstrip("/"))
    return name.rsplit(".", 1)[0]


def completed_shards(output: str, storage_options: StorageOptions = None) -> set[str]:
    """Ids of the shards whose result part exists, from one listing."""
    return {part_shard_id(u) for u in list_parts(results_uri(output), storage_options)}


def part_exists(
    output: str, shard_id: str, fmt: str, storage_options: StorageOptions = None
) -> bool:
    """Whether one shard's part is published (checked fresh, not from a cached listing)."""
    fs, path = resolve(join(results_uri(output), f"{shard_id}.{fmt}"), storage_options)
    fs.invalidate_cache(posixpath.dirname(path))
    with store_operation("checking", display(fs, path)):
        return fs.exists(path)


def write_shard(
    output: str,
    table: pa.Table,
    stats: ShardStats,
    *,
    fmt: str = "parquet",
    storage_options: StorageOptions = None,
) -> str:
    """Publish a shard: its stats, then its part (the part is the completion marker).

    Raises:
        FileExistsError: the part already exists (the shard was completed elsewhere).
    """
    write_json_atomic(
        join(output, STATS_DIR, f"{stats.shard_id}.json"), asdict(stats), storage_options
    )
    return write_part(
        table, results_uri(output), stats.shard_id, format=fmt, storage_options=storage_options
    )


def read_shard_part(
    output: str, shard_id: str, fmt: str, storage_options: StorageOptions = None
) -> pa.Table:
    """One completed shard's result rows (FileNotFoundError if its part is not published)."""
    return read_part(join(results_uri(output), f"{shard_id}.{fmt}"), storage_options)


def result_parts(output: str, storage_options: StorageOptions = None) -> dict[str, list[str]]:
    """Each completed shard's part URLs (normally one), from one listing."""
    parts: dict[str, list[str]] = {}
    for url in list_parts(results_uri(output), storage_options):
        parts.setdefault(part_shard_id(url), []).append(url)
    return parts


def read_results(output: str, storage_options: StorageOptions = None) -> pa.Table:
    """Every result row of a job, from all its parts (an empty results table if none)."""
    table = read_parts(results_uri(output), storage_options)
    return table if table.num_columns else RESULT_SCHEMA.empty_table()


def read_shard_stats(
    output: str, shard_ids: Iterable[str], storage_options: StorageOptions = None
) -> list[ShardStats]:
    """The stats of the given (completed) shards, read fresh: a long-lived worker's
    cached listing of the stats directory (from an earlier flow run, or before other
    workers wrote theirs) would otherwise hide stats written since."""
    fs, directory = resolve(join(output, STATS_DIR), storage_options)
    fs.invalidate_cache(directory)
    return [
        ShardStats(**read_json(join(output, STATS_DIR, f"{sid}.json"), storage_options))
        for sid in shard_ids
    ]


def remove_results(output: str, storage_options: StorageOptions = None) -> int:
    """Delete a job's parts and shard stats (for a fresh, non-resumed run).

    Returns:
        How many parts were removed.
    """
    parts = list_parts(results_uri(output), storage_options)
    for directory in (results_uri(output), join(output, STATS_DIR)):
        fs, path = resolve(directory, storage_options)
        fs.invalidate_cache(path)
        with store_operation("removing", display(fs, path)):
            if fs.exists(path):
                fs.rm(path, recursive=True)
    return len(parts)


def plan_uri(output: str) -> str:
    return join(output, PLAN_DIR)


def write_plan_shard(
    output: str, shard_id: str, table: pa.Table, storage_options: StorageOptions = None
) -> str:
    """Write one shard's planned rows (`spill.shard_table`), replacing an older copy.

    Replacing is safe: a shard id is a hash of the rows, so an older file of that name
    (from a killed run of the same job) holds the same rows.

    Returns:
        The file's URL.
    """
    return write_part(
        table, plan_uri(output), shard_id, storage_options=storage_options, overwrite=True
    )


def read_plan_shard(
    output: str,
    shard_id: str,
    storage_options: StorageOptions = None,
    *,
    columns: Iterable[str] | None = None,
) -> pa.Table:
    """One shard's planned rows (only `columns`, if given)."""
    url = join(plan_uri(output), f"{shard_id}.parquet")
    return read_part(url, storage_options, columns=list(columns) if columns else None)


def staged_piece_name(window: int, first_row: int) -> str:
    """The name of a window's rows staged from `first_row` on (they sort in input order)."""
    return f"{window:06d}-{first_row:012d}"


def write_staged_window(
    output: str, name: str, table: pa.Table, storage_options: StorageOptions = None
) -> str:
    """Write a planning window's tokenized rows (`spill.shard_table`, input order), or a
    run of them (`staged_piece_name`)."""
    return write_part(
        table,
        join(output, WINDOWS_DIR),
        name,
        storage_options=storage_options,
        overwrite=True,
    )


def read_staged_window(output: str, name: str, storage_options: StorageOptions = None) -> pa.Table:
    """One staged planning window's rows (or run of them)."""
    return read_part(join(output, WINDOWS_DIR, f"{name}.parquet"), storage_options)


def place_staged_shard(
    output: str, name: str, shard_id: str, storage_options: StorageOptions = None
) -> None:
    """Move a shard's rows written to the staging (`write_staged_window` as `name`) to
    its plan file, as `write_plan_shard` would have written them (replacing an older
    copy: same id, same rows). A move on a local disk, a copy within an object store.

    A move done before (a task run again after its worker died) is done: the staged
    file is gone and the plan file is there."""
    fs, staged = resolve(join(output, WINDOWS_DIR, f"{name}.parquet"), storage_options)
    _, planned = resolve(join(plan_uri(output), f"{shard_id}.parquet"), storage_options)
    try:
        with store_operation("moving", display(fs, staged)):
            if is_local(fs):
                os.makedirs(posixpath.dirname(planned), exist_ok=True)
                os.replace(staged, planned)
            else:
                fs.mv(staged, planned)
    except FileNotFoundError:
        fs.invalidate_cache(posixpath.dirname(planned))
        if not fs.exists(planned):
            raise


def id_bucket_uri(output: str, bucket: int) -> str:
    """The directory of one hash bucket's staged ids (`id_buckets.py`)."""
    return join(output, WINDOWS_DIR, f"ids-{bucket:05d}")


def remove_staged_windows(output: str, storage_options: StorageOptions = None) -> None:
    """Delete the staged planning windows (all of them: planning ended or restarts).

    A part of an earlier planning cancelled while it ran may still stage a file here
    (Dask does not stop a running task): a file landing while the directory is removed
    leaves it not empty, and the removal goes round again, a few times."""
    fs, directory = resolve(join(output, WINDOWS_DIR), storage_options)
    for attempt in range(1, STAGING_REMOVALS + 1):
        fs.invalidate_cache(directory)
        try:
            with store_operation("removing", display(fs, directory)):
                if fs.exists(directory):
                    fs.rm(directory, recursive=True)
            return
        except OSError as err:
            if err.errno != errno.ENOTEMPTY or attempt == STAGING_REMOVALS:
                raise
            time.sleep(0.1 * attempt)


def planned_shards(output: str, storage_options: StorageOptions = None) -> set[str]:
    """Ids of the shards that have a plan file, from one listing."""
    return {part_shard_id(u) for u in list_parts(plan_uri(output), storage_options)}


def remove_plan(
    output: str, storage_options: StorageOptions = None, *, shard_ids: Iterable[str] | None = None
) -> None:
    """Delete the plan files of `shard_ids`, or the whole `_plan/` directory (None)."""
    fs, directory = resolve(plan_uri(output), storage_options)
    fs.invalidate_cache(directory)
    with store_operation("removing", display(fs, directory)):
        _remove_plan_files(fs, directory, shard_ids)


def _remove_plan_files(fs, directory: str, shard_ids: Iterable[str] | None) -> None:
    if shard_ids is None:
        if fs.exists(directory):
            fs.rm(directory, recursive=True)
        return
    for sid in shard_ids:
        path = posixpath.join(directory, f"{sid}.parquet")
        if fs.exists(path):
            fs.rm(path)
    # An emptied directory goes too (object stores have none); rmdir refuses a directory
    # that another writer has just put a file into.
    fs.invalidate_cache(directory)
    if fs.exists(directory) and not fs.ls(directory):
        with contextlib.suppress(OSError):
            fs.rmdir(directory)


def write_ledger(
    ledger: JobLedger,
    output: str,
    *,
    ledger_dataset: str | None = None,
    storage_options: StorageOptions = None,
) -> str:
    """Write `OUTPUT/ledger.json` and record the job in the ledger dataset.

    The dataset holds one row per job, in a file named by the job id: finishing a job
    again (a rerun, or a recompute with resume off) replaces its row rather than adding
    one, so sums over the dataset count each job once and reflect its current results.

    Returns:
        The URL of the job's row file in the dataset.
    """
    write_json_atomic(join(output, LEDGER_FILE), ledger.to_dict(), storage_options)
    dataset = ledger_dataset or default_ledger_dataset(output)
    return write_part(
        ledger.to_arrow(),
        dataset,
        f"job-{ledger.job_id}",
        storage_options=storage_options,
        overwrite=True,
    )


def read_ledger_dataset(uri: str, storage_options: StorageOptions = None) -> pa.Table:
    """Every job recorded in a ledger dataset, oldest first.

    Rows written before a ledger column existed get its default where one is known:
    `task` "generate" (every job was one before scoring jobs).
    """
    table = read_parts(uri, storage_options)
    if not table.num_rows:
        return table
    if "task" not in table.column_names:
        table = table.append_column("task", pa.array([GENERATE] * table.num_rows, pa.string()))
    else:
        index = table.column_names.index("task")
        table = table.set_column(index, "task", pc.fill_null(table["task"], GENERATE))
    if "started_at" in table.column_names:
        table = table.sort_by([("started_at", "ascending")])
    return table


def read_ledger(output: str, storage_options: StorageOptions = None) -> JobLedger:
    """A job's `ledger.json`."""
    return JobLedger.from_dict(read_json(join(output, LEDGER_FILE), storage_options))


def openai_results_writer(
    output: str, storage_options: StorageOptions = None
) -> contextlib.AbstractContextManager[Callable[[str], None]]:
    """`with openai_results_writer(output) as write: write(line)` writes
    `OUTPUT/results.jsonl` (OpenAI batch output lines), replacing an older one when the
    block ends; a block that raises leaves the older one, or none."""
    return lines_writer(join(output, OPENAI_RESULTS_FILE), storage_options, overwrite=True)


def read_input_fingerprint(
    output: str, storage_options: StorageOptions = None
) -> list[dict[str, Any]] | None:
    """The fingerprint of the input the output's results came from (None: not recorded)."""
    try:
        return read_json(join(output, INPUT_FILE), storage_options)
    except FileNotFoundError:
        return None


def write_input_fingerprint(
    output: str, fingerprint: list[dict[str, Any]], storage_options: StorageOptions = None
) -> None:
    """Record the fingerprint of the input the output's results come from."""
    write_json_atomic(join(output, INPUT_FILE), fingerprint, storage_options)


def write_cut(
    output: str, min_shards: int, rule: str, storage_options: StorageOptions = None
) -> None:
    """Record how the job's shards were cut (`planning.plan_job`'s min_shards and the
    cut rule, `prefix_cut.py`)."""
    write_json_atomic(
        join(output, CUT_FILE), {"min_shards": min_shards, "rule": rule}, storage_options
    )


def read_cut(output: str, storage_options: StorageOptions = None) -> tuple[int, str | None] | None:
    """(min_shards, cut rule) the output's results were cut with (None: not recorded;
    the rule None: recorded before cuts had rules)."""
    try:
        recorded = read_json(join(output, CUT_FILE), storage_options)
    except FileNotFoundError:
        return None
    return int(recorded["min_shards"]), recorded.get("rule")


def write_progress(
    output: str, shard_id: str, progress: dict[str, Any], storage_options: StorageOptions = None
) -> None:
    """Record a running shard's progress (replacing its last record)."""
    write_json_atomic(join(output, PROGRESS_DIR, f"{shard_id}.json"), progress, storage_options)


def read_progress(output: str, storage_options: StorageOptions = None) -> dict[str, dict]:
    """Every shard's last progress record, by shard id (a record being replaced is skipped)."""
    fs, directory = resolve(join(output, PROGRESS_DIR), storage_options)
    fs.invalidate_cache(directory)
    if not fs.isdir(directory):
        return {}
    records = {}
    for path in fs.ls(directory, detail=False):
        name = posixpath.basename(path.rstrip("/"))
        if is_temp_name(name) or not name.endswith(".json"):
            continue
        with contextlib.suppress(FileNotFoundError, ValueError):
            records[name[: -len(".json")]] = read_json(
                join(output, PROGRESS_DIR, name), storage_options
            )
    return records


def remove_progress(output: str, storage_options: StorageOptions = None) -> None:
    """Delete the progress records (the job is finished)."""
    fs, directory = resolve(join(output, PROGRESS_DIR), storage_options)
    fs.invalidate_cache(directory)
    with store_operation("removing", display(fs, directory)):
        if fs.exists(directory):
            fs.rm(directory, recursive=True)


def write_forecast(
    output: str, forecast: dict[str, Any], storage_options: StorageOptions = None
) -> None:
    """Record a dry run's forecast (a `Forecast.to_dict()`) in the output."""
    write_json_atomic(join(output, FORECAST_FILE), forecast, storage_options)


def read_forecast(output: str, storage_options: StorageOptions = None) -> dict[str, Any] | None:
    """The forecast a dry run recorded in the output (None: none was)."""
    try:
        return read_json(join(output, FORECAST_FILE), storage_options)
    except FileNotFoundError:
        return None


def remove_temp_files(output: str, storage_options: StorageOptions = None) -> int:
    """Delete temporary files that killed runs left in the output's directories.

    Only call it holding the output's lock: then no live writer owns any of them.
    A ledger dataset outside OUTPUT is shared by jobs and is not touched.

    Returns:
        How many were removed.
    """
    removed = 0
    for directory in (
        output,
        results_uri(output),
        join(output, STATS_DIR),
        plan_uri(output),
        join(output, PROGRESS_DIR),
        default_ledger_dataset(output),
    ):
        fs, path = resolve(directory, storage_options)
        fs.invalidate_cache(path)
        if not fs.isdir(path):
            continue
        for entry in fs.ls(path, detail=False):
            if is_temp_name(posixpath.basename(entry.rstrip("/"))):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(entry)
                    removed += 1
    return removed
