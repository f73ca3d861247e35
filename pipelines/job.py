"""A batch job in three separately callable steps: plan, run shards, finalize.

    plan_job(spec)             read + template + tokenize + shard, window by window,
                               writing each shard's rows to OUTPUT/_plan/; every input
                               problem (bad file, missing column, duplicate ids) raises
                               here, before the model is loaded
    run_shard(llm, plan, s)    read one shard's rows, generate, publish its part; idempotent
    finalize_job(plan, ...)    check the parts one by one, write the ledger, drop _plan/

`run_job` composes them; the Prefect flows call them as separate tasks, so their
inputs and outputs are plain picklable dataclasses. A JobPlan holds shard names and
sizes, never rows, so what a worker receives and what any step keeps in memory is
bounded by a planning window or a shard, not by the dataset. Prompts and outputs are
never logged - only counts.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from tokenmill.connectors import open_source, read_part
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines import output as out
from tokenmill.pipelines.ledger import (
    JobLedger,
    ShardStats,
    add_token_sums,
    compute_ledger,
    token_sums,
)
from tokenmill.pipelines.plan import PlannedShard, Shard, job_id, plan_shards
from tokenmill.pipelines.reading import Window, read_windows
from tokenmill.pipelines.results import RESULT_SCHEMA, build_results, latencies
from tokenmill.pipelines.spec import JobSpec, ParamsTable
from tokenmill.pipelines.spill import shard_rows, shard_table
from tokenmill.pipelines.templating import required_columns, text_columns

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]


@dataclass
class JobPlan:
    """A planned job: its shards' names and sizes. Each shard's rows (tokens, ids,
    passthrough columns) are in its plan file, `OUTPUT/_plan/<shard_id>.parquet`."""

    spec: JobSpec
    job_id: str
    model_name: str
    model_dir: str
    weights_hash: str
    max_model_len: int
    params: list[SamplingParams]
    shards: list[Shard]
    num_rows: int = 0
    num_failed: int = 0  # rows that failed before compute (bad prompt, too long, ...)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


@dataclass
class ShardResult:
    """What running one shard did (counts only)."""

    shard_id: str
    skipped: bool  # already complete: nothing was computed
    num_rows: int
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    device_seconds: float = 0.0


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def model_name(model: str | None) -> str:
    """How the ledger names a model: the alias, or a directory's or file's base name."""
    from tokenmill.engine.model_files import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    return path.name if path.exists() else str(model)


def _canonical_location(uri: str) -> str:
    # "out", "./out" and "/abs/out" are one place, so they are one job.
    return uri if "://" in uri else os.path.abspath(uri)


def _model_facts(model: str | None) -> tuple[str, int, str]:
    """(model dir, context length, weights hash) without loading any weights."""
    from tokenmill.engine.config import ModelConfig
    from tokenmill.engine.model_files import resolve_model, weights_hash

    model_dir = resolve_model(model)
    return (
        str(model_dir),
        ModelConfig.from_dir(model_dir).max_context,
        weights_hash(model_dir),
    )


def plan_job(spec: JobSpec, *, tokenizer: Any = None, llm: Any = None) -> JobPlan:
    """Read, template, tokenize and shard a job - everything before compute.

    The source is opened and validated first (missing file, corrupt file, bad URL,
    missing column -> `SourceError` naming the file), then the model's files are
    resolved (no weights are loaded), then the rows are read and tokenized window by
    window (`spec.plan_window_rows`); each window is cut into shards whose rows are
    written to `OUTPUT/_plan/` before the next window is read. If planning fails
    (e.g. duplicate ids, found after the last window), the plan files it added are
    removed again.

    Args:
        spec: the job.
        tokenizer: the model's tokenizer (default: loaded from the model directory).
        llm: an already loaded LLM; its tokenizer and context length are used.

    Returns:
        The JobPlan.

    Raises:
        ValueError: bad input (SourceError), duplicate or null ids, bad options.
    """
    template = spec.template_spec
    columns = None if spec.is_openai_batch else [*required_columns(template), *spec.passthrough]
    source = open_source(
        spec.input,
        format=spec.format,
        storage_options=spec.storage_options,
        columns=list(dict.fromkeys(columns)) if columns is not None else None,
        on_bad_line="skip_row",
        text_columns=text_columns(template),
    )
    if llm is not None:
        model_dir, max_len = str(llm.model_dir), llm.max_model_len
        from tokenmill.engine.model_files import weights_hash

        w_hash = weights_hash(model_dir)
        tokenizer = tokenizer or llm.tokenizer
    else:
        model_dir, max_len, w_hash = _model_facts(spec.model)
        max_len = min(max_len, spec.engine_options.get("max_model_len") or max_len)
    if tokenizer is None:
        from tokenmill.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
    params = ParamsTable(spec.sampling)
    shards: list[Shard] = []
    num_rows = num_failed = 0
    # Another plan's files may have our shard ids (same rows, same id): if this planning
    # fails, it removes only the files it added.
    existing = out.planned_shards(spec.output, spec.storage_options)
    try:
        for window in read_windows(source, spec, tokenizer, max_model_len=max_len, params=params):
            for planned in plan_shards(
                window.rows,
                params.params,
                model_key=w_hash,
                shard_tokens=spec.shard_tokens,
                first_index=len(shards),
                window=window.index,
            ):
                _spill(spec, planned, window)
                shards.append(planned.shard)
            num_rows += len(window.rows)
            num_failed += sum(1 for r in window.rows if r.error is not None)
    except BaseException:
        added = [s.shard_id for s in shards if s.shard_id not in existing]
        out.remove_plan(spec.output, spec.storage_options, shard_ids=added)
        raise
    plan = JobPlan(
        spec=spec,
        job_id=job_id(shards, output=_canonical_location(spec.output)),
        model_name=model_name(getattr(llm, "model_name", None) if llm is not None else spec.model),
        model_dir=model_dir,
        weights_hash=w_hash,
        max_model_len=max_len,
        params=params.params,
        shards=shards,
        num_rows=num_rows,
        num_failed=num_failed,
    )
    log.info(
        "planned job %s: %d rows (%d failed before compute), %d shards, ~%d tokens",
        plan.job_id,
        plan.num_rows,
        plan.num_failed,
        len(shards),
        plan.num_tokens,
    )
    return plan


def _spill(spec: JobSpec, planned: PlannedShard, window: Window) -> None:
    """Write a shard's rows, with their passthrough columns and urls, to its plan file."""
    local = [r.row_index - window.start for r in planned.rows]
    passthrough = None
    if window.passthrough is not None:
        passthrough = window.passthrough.take(pa.array(local, pa.int64()))
    endpoints = [window.endpoints[i] for i in local] if window.endpoints is not None else None
    table = shard_table(planned.rows, passthrough=passthrough, endpoints=endpoints)
    out.write_plan_shard(spec.output, planned.shard.shard_id, table, spec.storage_options)


def load_shard(plan: JobPlan, shard: Shard, *, columns: list[str] | None = None) -> pa.Table:
    """A shard's plan file (only `columns`, if given), checked against the plan.

    Raises:
        RuntimeError: the file is gone (the job finished and dropped it, or it was
            deleted) or does not hold the shard's rows.
    """
    spec = plan.spec
    try:
        table = out.read_plan_shard(
            spec.output, shard.shard_id, spec.storage_options, columns=columns
        )
    except FileNotFoundError:
        raise RuntimeError(
            f"shard {shard.shard_id} of job {plan.job_id} has no plan file under "
            f"{out.plan_uri(spec.output)}: plan the job again (rerun it) to recreate it"
        ) from None
    if table.num_rows != shard.num_rows:
        raise RuntimeError(
            f"the plan file of shard {shard.shard_id} holds {table.num_rows} rows, "
            f"the plan {shard.num_rows}: plan the job again (rerun it)"
        )
    return table


def prepare_output(plan: JobPlan) -> set[str]:
    """Check the output directory against the plan; return the shards already complete.

    With resume on, parts that are not shards of this plan mean the directory holds
    another job's results, which a rerun must not mix with its own: that raises. With
    resume off, earlier results are removed first.
    """
    spec = plan.spec
    if not spec.resume:
        removed = out.remove_results(spec.output, spec.storage_options)
        if removed:
            log.info("resume off: removed %d earlier result parts", removed)
        stale = out.planned_shards(spec.output, spec.storage_options)
        stale -= {s.shard_id for s in plan.shards}
        out.remove_plan(spec.output, spec.storage_options, shard_ids=stale)
        return set()
    done = out.completed_shards(spec.output, spec.storage_options)
    foreign = sorted(done - {s.shard_id for s in plan.shards})
    if foreign:
        raise ValueError(
            f"{out.results_uri(spec.output)} holds {len(foreign)} part(s) that are not shards of "
            f"this job (e.g. {foreign[0]}): the input, model or options changed since they were "
            "written. Use a new output location, or resume=False (--no-resume) to replace them."
        )
    return done


def run_shard(
    llm: Any, plan: JobPlan, shard: Shard, *, on_output: OnOutput | None = None
) -> ShardResult:
    """Generate one shard's rows and publish its results part.

    Idempotent: a shard whose part already exists is skipped, so a retried or resumed
    task never computes or writes a shard twice.

    Args:
        llm: a loaded `tokenmill.engine.llm.LLM` (anything with its `generate`).
        plan: the job plan.
        shard: one of `plan.shards`.
        on_output: called with each RequestOutput as it finishes (progress bars).

    Returns:
        The ShardResult.
    """
    spec = plan.spec
    if spec.resume and out.part_exists(
        spec.output, shard.shard_id, spec.part_format, spec.storage_options
    ):
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    planned = shard_rows(load_shard(plan, shard))
    rows = planned.rows
    good = [r for r in rows if r.token_ids is not None]
    started_at, t0 = now_iso(), time.perf_counter()
    outputs: dict[int, RequestOutput] = {}
    if good:
        generated = llm.generate(
            [r.token_ids for r in good],
            [plan.params[r.params_index] for r in good],
            on_output=on_output,
        )
        outputs = {r.row_index: o for r, o in zip(good, generated)}
    seconds = time.perf_counter() - t0
    table = build_results(rows, outputs, passthrough=planned.passthrough)
    stats = ShardStats(
        shard_id=shard.shard_id,
        num_rows=len(rows),
        device=str(getattr(llm, "device", "")),
        device_seconds=seconds if good else 0.0,
        started_at=started_at,
        finished_at=now_iso(),
        latencies=latencies(outputs),
    )
    try:
        out.write_shard(
            spec.output, table, stats, fmt=spec.part_format, storage_options=spec.storage_options
        )
    except FileExistsError:
        # Another worker published this shard first; its part stands, ours is dropped.
        log.info("shard %s was completed elsewhere meanwhile; keeping that part", shard.shard_id)
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    result = _shard_result(shard.shard_id, table, stats.device_seconds)
    log.info(
        "shard %s: %d rows (%d failed), %.2fs",
        shard.shard_id,
        result.num_rows,
        result.rows_failed,
        result.device_seconds,
    )
    return result


def _shard_result(shard_id: str, table: pa.Table, seconds: float) -> ShardResult:
    rows = table.to_pydict()
    return ShardResult(
        shard_id=shard_id,
        skipped=False,
        num_rows=table.num_rows,
        rows_failed=sum(1 for r in rows["finish_reason"] if r == "error"),
        prompt_tokens=sum(rows["prompt_tokens"]),
        cached_tokens=sum(rows["cached_tokens"]),
        completion_tokens=sum(rows["completion_tokens"]),
        device_seconds=seconds,
    )


def finalize_job(
    plan: JobPlan,
    *,
    run_id: str | None = None,
    run_started_at: str | None = None,
    num_shards_run: int = 0,
) -> JobLedger:
    """Check every part against its shard, write the ledger, and drop the plan files.

    Parts are read one at a time, so memory is bounded by a shard (a window, for
    OpenAI batch output, which is written in input order). The ledger's token sums
    are added up from the rows read back, so they equal the sums over the results
    exactly, however many runs it took.

    Args:
        plan: the job plan.
        run_id: this run's id (default: a new uuid).
        run_started_at: when this run started (ISO); the ledger's start is the earliest
            of this and the shards' own start times.
        num_shards_run: how many shards this run computed (for the ledger).

    Returns:
        The JobLedger, also written to `OUTPUT/ledger.json` and the ledger dataset.

    Raises:
        RuntimeError: shards are missing or the parts do not match the plan.
    """
    from tokenmill import __version__

    spec = plan.spec
    parts = out.result_parts(spec.output, spec.storage_options)
    missing = [s.shard_id for s in plan.shards if s.shard_id not in parts]
    if missing:
        raise RuntimeError(
            f"job {plan.job_id} is incomplete: {len(missing)} of {len(plan.shards)} shards "
            f"have no results part (e.g. {missing[0]}); run the job again to finish them"
        )
    foreign = sorted(set(parts) - {s.shard_id for s in plan.shards})
    if foreign:
        raise RuntimeError(
            f"results of job {plan.job_id} do not match its plan: {len(foreign)} part(s) "
            f"are not shards of this job (e.g. {foreign[0]})"
        )
    sums = token_sums(RESULT_SCHEMA.empty_table())
    checked = _checked_parts(plan, parts, sums=sums)
    if spec.output_format == "openai-batch":
        # One pass over the parts: each is checked, added up and turned into output
        # lines in turn. The file is written atomically, so a part that fails its check
        # leaves no output file behind.
        lines = _openai_lines(plan, checked, created=int(time.time()))
        out.write_openai_results(spec.output, lines, spec.storage_options)
    else:
        for _ in checked:
            pass
    stats = out.read_shard_stats(
        spec.output, [s.shard_id for s in plan.shards], spec.storage_options
    )
    starts = [s.started_at for s in stats] + ([run_started_at] if run_started_at else [])
    ledger = compute_ledger(
        sums,
        stats,
        prices=spec.prices,
        job_id=plan.job_id,
        run_id=run_id or uuid.uuid4().hex,
        model=plan.model_name,
        weights_hash=plan.weights_hash,
        engine_version=__version__,
        input_uri=spec.input,
        output_uri=spec.output,
        started_at=min(starts) if starts else now_iso(),
        finished_at=now_iso(),
        num_shards=len(plan.shards),
        num_shards_run=num_shards_run,
    )
    out.write_ledger(
        ledger,
        spec.output,
        ledger_dataset=spec.ledger_dataset,
        storage_options=spec.storage_options,
    )
    try:
        out.remove_plan(spec.output, spec.storage_options)
    except OSError as exc:  # the job is done; leftover plan files are only clutter
        log.warning("job %s: could not remove its plan files: %s", plan.job_id, exc)
    log.info(
        "job %s finished: %d ok, %d failed, cost %.6f USD",
        plan.job_id,
        ledger.rows_ok,
        ledger.rows_failed,
        ledger.cost_total,
    )
    return ledger


def _shard_results(urls: list[str], spec: JobSpec) -> pa.Table:
    """One shard's result rows (normally one part; more only if a part was duplicated)."""
    tables = [read_part(url, spec.storage_options) for url in urls]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")


def _checked_parts(
    plan: JobPlan, parts: dict[str, list[str]], *, sums: dict[str, int]
) -> Iterator[tuple[Shard, pa.Table, pa.Table]]:
    """Each shard's results and plan file, in plan order, once each has been checked to
    hold exactly the shard's planned ids; their token sums are added into `sums`.

    The plan file is read with the columns OpenAI batch output also needs, so no part
    or plan file is read twice.

    Raises:
        RuntimeError: a part does not hold its shard's planned ids, once each.
    """
    columns = ["id", "row_index", "url"] if plan.spec.output_format == "openai-batch" else ["id"]
    for shard in plan.shards:
        results = _shard_results(parts[shard.shard_id], plan.spec)
        planned = load_shard(plan, shard, columns=columns)
        ids = results["id"].to_pylist() if results.num_rows else []
        expected = set(planned["id"].to_pylist())
        if len(ids) != shard.num_rows or len(set(ids)) != len(ids) or set(ids) != expected:
            raise RuntimeError(
                f"results of job {plan.job_id} do not match its plan: shard {shard.shard_id} "
                f"has {len(ids)} rows ({len(set(ids))} distinct ids) for {shard.num_rows} "
                "planned rows"
            )
        sums.update(add_token_sums(sums, results))
        yield shard, results, planned


def _openai_lines(
    plan: JobPlan, checked: Iterator[tuple[Shard, pa.Table, pa.Table]], *, created: int
) -> Iterator[str]:
    """OpenAI batch output lines in input order, one window at a time.

    A window's shards cover a contiguous range of rows, so sorting each window's rows
    by row index and writing the windows in order gives the input order.
    """
    from tokenmill.connectors import openai_batch_output_lines

    for _, in_window in itertools.groupby(checked, key=lambda item: item[0].window):
        tables = []
        for _, results, planned in in_window:
            where = {rid: i for i, rid in enumerate(planned["id"].to_pylist())}
            take = pa.array([where[rid] for rid in results["id"].to_pylist()], pa.int64())
            results = results.append_column("url", planned["url"].take(take))
            tables.append(results.append_column("_row_index", planned["row_index"].take(take)))
        window = pa.concat_tables(tables, promote_options="permissive").sort_by("_row_index")
        yield from openai_batch_output_lines(
            window.drop_columns(["_row_index"]),
            model_name=plan.model_name,
            batch_id=plan.job_id,
            created=created,
        )


class JobProgress:
    """Hooks `run_job` calls as it goes; override any of them (e.g. a progress bar)."""

    def planned(self, plan: JobPlan, pending: list[Shard]) -> None:
        """The plan is ready; `pending` shards will be computed."""

    def request_done(self, output: RequestOutput) -> None:
        """One request finished."""

    def shard_done(self, result: ShardResult) -> None:
        """One shard's part is published."""


def load_llm(spec: JobSpec) -> Any:
    """Load the job's model (the one expensive step `plan_job` avoids)."""
    from tokenmill.engine.llm import LLM

    return LLM(spec.model, dtype=spec.dtype, device=spec.device, **spec.engine_options)


def run_job(
    input: str,
    output: str,
    *,
    llm: Any = None,
    progress: JobProgress | None = None,
    **options: Any,
) -> JobLedger:
    """Run a batch job end to end: plan, compute the missing shards, write the ledger.

    Rerunning the same job into the same output resumes it: complete shards are
    skipped, and the results hold exactly one row per input row.

    Args:
        input: dataset URL or path.
        output: output directory URL or path.
        llm: an already loaded LLM to use (default: load `model` when there is work).
        progress: hooks for progress reporting.
        **options: any other `JobSpec` field (model, template, sampling, prices,
            shard_tokens, storage_options, resume, ...). Sampling may be given as
            `sampling=SamplingParams(...)`, or as its fields (max_tokens, temperature,
            top_p, top_k, min_p, seed, stop, ...).

    Returns:
        The JobLedger.
    """
    spec = JobSpec(input, output, **_spec_options(options))
    progress = progress or JobProgress()
    run_started_at = now_iso()
    plan = plan_job(spec, llm=llm)
    done = prepare_output(plan)
    pending = [s for s in plan.shards if s.shard_id not in done]
    if pending and llm is None:
        llm = load_llm(spec)
    progress.planned(plan, pending)
    for shard in pending:
        result = run_shard(llm, plan, shard, on_output=progress.request_done)
        progress.shard_done(result)
    return finalize_job(plan, run_started_at=run_started_at, num_shards_run=len(pending))


_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def _spec_options(options: dict[str, Any]) -> dict[str, Any]:
    """Split sampling fields (max_tokens=...) out of run_job's options into SamplingParams."""
    options = dict(options)
    sampling = {k: options.pop(k) for k in list(options) if k in _SAMPLING_FIELDS}
    if sampling:
        if "sampling" in options:
            raise ValueError("give sampling=SamplingParams(...) or its fields, not both")
        options["sampling"] = SamplingParams(**{"temperature": 0.0, **sampling})
    if "prices" in options and isinstance(options["prices"], dict):
        from tokenmill.pipelines.pricing import Prices

        options["prices"] = Prices(**options["prices"])
    return options
