"""Planning spread over a cluster's workers: the same plan as `plan_job`, read in parallel.

Where planning's time goes: templating and tokenizing every row. Where its state crosses
rows: a shard's id starts with its running index over the whole job, duplicates are
found across windows (`dedupe.py`), and ids must be unique over the input (`ids.py`).
The design keeps the parallel part free of that state and leaves the rest to the very
code the local planner runs, so the plan is exactly the local one, by construction:

1. The driver opens the source and describes the model (`prepare_planning`): a bad
   file, a missing column or a bad option fails here, before any task starts.
2. Parts, one task each, on the workers (`read_part`): part j of P templates and
   tokenizes the planning windows j, j + P, j + 2P, ... - the local planner's own
   windows of `plan_window_rows` consecutive rows, so nothing about a window changes -
   and writes each one's rows, in input order, to `OUTPUT/_windows/<index>.parquet`
   (`spill.shard_table`). It reads the other windows' rows for their ids only, so every
   part checks every id: a null or duplicate id fails the part, and so planning, with
   the local planner's message, and the driver holds no id.
3. The driver then runs the local planner's window loop (`plan_windows`) over the staged
   windows in input order: dedupe, order, cut, plan files, running shard index. A window
   is one table in memory at a time; across windows the driver holds what the local
   planner holds for dedupe (28 bytes per distinct deterministic row) and the shards.

Not spread (planned on the driver as before, saying why): per-row sampling params (an
OpenAI batch file, a `json_schema_column`: the job's params table grows in input order
and its indices are in the shard ids), image rows (a staged row does not carry its
images' content hashes) and a job planned for an already loaded LLM.

What it does not do yet: each part parses the whole input (the skipped windows for their
ids only - no templating, no tokenizing), and step 3 is serial on the driver. Splitting
the input by byte range or row group, and deduplicating by hash buckets on the workers
with shard ids from (window, offset), would lift both - at the price of other shard ids
than the local planner's for the same job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tokenmill.connectors.fingerprint import first_difference
from tokenmill.pipelines import output as out
from tokenmill.pipelines.planning import (
    JobPlan,
    PlanningInputs,
    plan_windows,
    prepare_planning,
    read_job_windows,
)
from tokenmill.pipelines.reading import Window
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_rows, shard_table

log = logging.getLogger(__name__)

T = TypeVar("T")


class FanOut(Protocol):
    """Runs calls on a cluster's workers (`flows/runners.py` has Dask's)."""

    num_parts: int  # how many parts to split the reading into: one per worker

    def map(self, fn: Callable[..., T], args: Sequence[tuple]) -> list[T]:
        """`[fn(*a) for a in args]`, each call a task; the first error raised, as raised."""
        ...


@dataclass(frozen=True)
class PartSummary:
    """What a part read: the windows it staged, and what the reader met over the input."""

    part: int
    windows: tuple[tuple[int, int, int], ...]  # (window index, first row, rows) staged
    rows_read: int  # every row of the input (the part read them all, for their ids)
    rows_skipped_blank: int
    fingerprint: list[dict[str, Any]]  # the input's files as the part found them


def spread_refusal(spec: JobSpec, inputs: PlanningInputs) -> str | None:
    """Why this job cannot be planned spread over workers (None: it can)."""
    if spec.is_openai_batch:
        return "an OpenAI batch file's lines carry their own sampling params"
    if spec.json_schema_column is not None:
        return f"rows carry their own JSON schema ({spec.json_schema_column!r})"
    if inputs.images is not None:
        return "the job reads images"
    return None


def plan_job_spread(spec: JobSpec, *, fan_out: FanOut, min_shards: int = 1) -> JobPlan:
    """`plan_job`, with reading, templating and tokenizing run as `fan_out` tasks.

    Args:
        spec: the job.
        fan_out: runs the parts on the workers; `fan_out.num_parts` parts.
        min_shards: as for `plan_job`.

    Returns:
        The JobPlan `plan_job(spec, min_shards=min_shards)` returns, with the same plan
        files.

    Raises:
        ValueError: bad input, as `plan_job` raises it (a part's error is raised as is).
    """
    inputs = prepare_planning(spec, min_shards=min_shards)
    refusal = spread_refusal(spec, inputs)
    if refusal is not None:
        log.info("planning on this process, not spread over workers: %s", refusal)
        return plan_windows(spec, inputs, read_job_windows(spec, inputs))
    num_parts = max(1, fan_out.num_parts)
    out.remove_staged_windows(spec.output, spec.storage_options)  # a killed run's
    try:
        summaries = fan_out.map(read_part, [(spec, part, num_parts) for part in range(num_parts)])
        staged = _staged(summaries, inputs.fingerprint)
        inputs.counts.rows = summaries[0].rows_read
        inputs.counts.blank = summaries[0].rows_skipped_blank
        return plan_windows(spec, inputs, _staged_windows(spec, staged))
    finally:
        out.remove_staged_windows(spec.output, spec.storage_options)


def read_part(spec: JobSpec, part: int, num_parts: int) -> PartSummary:
    """Template and tokenize windows `part`, `part + num_parts`, ... and stage them
    (a task on a worker: the model is described, not loaded, here too)."""
    inputs = prepare_planning(spec)
    staged = []
    for window in read_job_windows(spec, inputs, keep=lambda index: index % num_parts == part):
        table = shard_table(window.rows, passthrough=window.passthrough)
        out.write_staged_window(spec.output, window.index, table, spec.storage_options)
        staged.append((window.index, window.start, len(window.rows)))
    return PartSummary(
        part, tuple(staged), inputs.counts.rows, inputs.counts.blank, inputs.fingerprint
    )


def _staged(
    summaries: Sequence[PartSummary], fingerprint: list[dict[str, Any]]
) -> list[tuple[int, int, int]]:
    """Every staged window in input order, checked to cover the input once: the parts
    must have read the input the driver opened (a file that changed under them fails)."""
    for summary in summaries:
        change = first_difference(fingerprint, summary.fingerprint)
        if change is not None:
            raise RuntimeError(
                f"the input changed while it was planned ({change}): plan the job again"
            )
    read = {(s.rows_read, s.rows_skipped_blank) for s in summaries}
    if len(read) != 1:
        raise RuntimeError(
            f"the parts of the input read different numbers of records ({sorted(read)}): "
            "the input changed while it was planned"
        )
    staged = sorted(w for s in summaries for w in s.windows)
    start = 0
    for number, (index, first, num_rows) in enumerate(staged):
        if index != number or first != start:
            raise RuntimeError(f"planning window {number} was not staged (found {index})")
        start += num_rows
    if start != summaries[0].rows_read:
        raise RuntimeError(f"{start} rows staged of {summaries[0].rows_read} read")
    return staged


def _staged_windows(spec: JobSpec, staged: Sequence[tuple[int, int, int]]) -> Iterator[Window]:
    for index, first, num_rows in staged:
        read = shard_rows(out.read_staged_window(spec.output, index, spec.storage_options))
        if len(read.rows) != num_rows:
            raise RuntimeError(
                f"planning window {index} holds {len(read.rows)} rows, not {num_rows}"
            )
        yield Window(index, first, rows=read.rows, passthrough=read.passthrough)
