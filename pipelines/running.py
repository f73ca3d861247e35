"""Running a planned job's shards: check the output, then generate (or score) shard by shard.

A shard is done when its results part exists; parts are published atomically and
never overwritten, so `run_shard` is idempotent: a retried, resumed or duplicated
shard task finds the part and computes nothing. An engine failure mid-shard is
handled by the one rule of `pipelines/engine_failures.py` (retry once, then isolate
the failing requests as error rows). A copy shard (`pipelines/dedupe.py`) computes
nothing: its rows take their sources' answers from the sources' published parts, so
it can run as soon as those are published (`copies_ready`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tokenmill.engine import EngineStats, RequestOutput
from tokenmill.pipelines import output as out
from tokenmill.pipelines.adapters import adapter_names
from tokenmill.pipelines.engine_failures import generate_with_rule
from tokenmill.pipelines.ledger import ShardStats, now_iso, token_sums
from tokenmill.pipelines.logprobs import LogprobsColumn
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, load_shard
from tokenmill.pipelines.reasoning import split_answers
from tokenmill.pipelines.results import (
    ERROR_CODE,
    build_results,
    copy_results,
    latencies,
    logprobs_column,
)
from tokenmill.pipelines.spill import ShardRows, shard_rows
from tokenmill.pipelines.tokenize import PromptRow

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]
OnStep = Callable[[EngineStats], None]


@dataclass
class ShardResult:
    """What running one shard did (counts only; token sums come from the parts)."""

    shard_id: str
    skipped: bool  # already complete: nothing was computed
    num_rows: int
    rows_failed: int = 0
    device_seconds: float = 0.0
    prompt_tokens: int = 0  # billed by the part's rows (0 when skipped)
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, the reasoning's


def completed_shards(plan: JobPlan) -> set[str]:
    """The plan's shards already complete in the output (none with resume off), read only.

    Raises:
        ValueError: with resume on, the output holds parts that are not shards of this
            plan: another job's results, which a rerun must not mix with its own.
    """
    spec = plan.spec
    if not spec.resume:
        return set()
    done = out.completed_shards(spec.output, spec.storage_options)
    foreign = sorted(done - {s.shard_id for s in plan.shards})
    if foreign:
        raise ValueError(
            f"{out.results_uri(spec.output)} holds {len(foreign)} part(s) that are not "
            f"shards of this job (e.g. {foreign[0]}): the input, model or options changed "
            "since they were written. Use a new output location, or resume=False "
            "(--no-resume) to replace them."
        )
    return done


def prepare_output(plan: JobPlan) -> set[str]:
    """Check the output directory against the plan; return the shards already complete.

    With resume on, parts that are not shards of this plan mean the directory holds
    another job's results, which a rerun must not mix with its own: that raises. With
    resume off, earlier results are removed first. The input's fingerprint is then
    recorded, for the next run's check (`planning._check_input_unchanged`).
    """
    spec = plan.spec
    if not spec.resume:
        removed = out.remove_results(spec.output, spec.storage_options)
        if removed:
            log.info("resume off: removed %d earlier result parts", removed)
        stale = out.planned_shards(spec.output, spec.storage_options)
        stale -= {s.shard_id for s in plan.shards}
        out.remove_plan(spec.output, spec.storage_options, shard_ids=stale)
    done = completed_shards(plan)
    # Recorded before any part of this input is published (planning checked it).
    out.write_input_fingerprint(spec.output, plan.input_fingerprint, spec.storage_options)
    out.write_cut(spec.output, plan.min_shards, plan.cut_rule, spec.storage_options)
    return done


def copies_ready(plan: JobPlan, published: Shard) -> list[Shard]:
    """The copy shards that take answers from `published` (a compute shard whose part
    is published) and whose other sources are published too: they can be written now.

    Whoever publishes a copy shard's last source finds it ready, since each compute
    shard publishes its part before asking; two that finish together may both find
    it, and `run_shard` keeps the first part written.
    """
    spec = plan.spec
    ready = []
    for shard in plan.shards:
        if not shard.is_copy or published.shard_id not in shard.sources:
            continue
        others = [s for s in shard.sources if s != published.shard_id]
        if all(
            out.part_exists(spec.output, s, spec.part_format, spec.storage_options) for s in others
        ):
            ready.append(shard)
    return ready


def run_shard(
    llm: Any,
    plan: JobPlan,
    shard: Shard,
    *,
    on_output: OnOutput | None = None,
    on_step: OnStep | None = None,
) -> ShardResult:
    """Generate one shard's rows and publish its results part.

    Idempotent: a shard whose part already exists is skipped, so a retried or resumed
    task never computes or writes a shard twice.

    Args:
        llm: a loaded `tokenmill.engine.api.llm.LLM` (anything with its `generate`); the
            caller holds its lock if other threads share it. Unused by a copy shard.
        plan: the job plan.
        shard: one of `plan.shards`.
        on_output: called with each RequestOutput as it finishes (progress bars).
        on_step: called after each engine step with the engine's cumulative stats
            (progress per token; `LLM.generate`'s hook).

    Returns:
        The ShardResult.

    Raises:
        RuntimeError: a copy shard whose sources are not all published (a copy shard
            runs once its sources are: `copies_ready`).
    """
    spec = plan.spec
    if spec.resume and out.part_exists(
        spec.output, shard.shard_id, spec.part_format, spec.storage_options
    ):
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    planned = shard_rows(load_shard(plan, shard))
    if shard.is_copy:
        return _publish(plan, shard, _copies_table(plan, shard, planned), now_iso(), 0.0, [])
    rows = planned.rows
    good = [r for r in rows if r.token_ids is not None]
    started_at, t0 = now_iso(), time.perf_counter()
    outputs = generate_with_rule(
        llm,
        good,
        plan.params,
        shard_id=shard.shard_id,
        on_output=on_output,
        on_step=on_step,
        loras=plan.lora_requests,
    )
    seconds = time.perf_counter() - t0
    if planned.endpoints is not None:
        endpoints = {r.row_index: url for r, url in zip(rows, planned.endpoints)}
    else:
        endpoints = None
    split_answers(llm, plan.reasoning_format, outputs, endpoints)
    table = build_results(
        rows,
        outputs,
        passthrough=planned.passthrough,
        task=spec.task,
        extras=plan.result_extras,
        adapters=adapter_names(plan.adapters),
        layout=plan.layout,
        logprobs=logprobs_column(llm, plan.params),
    )
    device = str(getattr(llm, "device", ""))
    device_seconds = seconds if good else 0.0
    return _publish(plan, shard, table, started_at, device_seconds, latencies(outputs), device)


def stop_shard(plan: JobPlan, shard: Shard, *, error: str, error_code: str) -> ShardResult:
    """Publish a compute shard's rows as error rows that bill nothing, without computing
    them: a stopped job's unfinished work (a cancelled or expired batch), answered once
    like any other row. Each row carries `error` and `error_code` (the OpenAI batch
    output's error code). Idempotent as `run_shard` is: a shard already complete stays.

    Raises:
        ValueError: a copy shard (run it with `run_shard`: its rows take their sources'
            answers or errors).
    """
    if shard.is_copy:
        raise ValueError(f"shard {shard.shard_id} is a copy shard: run it, do not stop it")
    spec = plan.spec
    if out.part_exists(spec.output, shard.shard_id, spec.part_format, spec.storage_options):
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    planned = shard_rows(load_shard(plan, shard))
    rows = [PromptRow(r.row_index, r.id, error=r.error or error) for r in planned.rows]
    table = build_results(
        rows,
        {},
        passthrough=planned.passthrough,
        task=spec.task,
        extras=plan.result_extras,
        adapters=adapter_names(plan.adapters),
        layout=plan.layout,
        # No row has an output, so no token is ever described.
        logprobs=LogprobsColumn(lambda ids: [], plan.params),
    )
    codes = [error_code if r.error is None else None for r in planned.rows]
    table = table.append_column(ERROR_CODE, pa.array(codes, pa.string()))
    return _publish(plan, shard, table, now_iso(), 0.0, [])


def _publish(
    plan: JobPlan,
    shard: Shard,
    table: pa.Table,
    started_at: str,
    device_seconds: float,
    request_latencies: list[float],
    device: str = "",
) -> ShardResult:
    """Write a shard's stats and part; the ShardResult."""
    spec = plan.spec
    sums = token_sums(table)
    stats = ShardStats(
        shard_id=shard.shard_id,
        num_rows=table.num_rows,
        device=device,
        device_seconds=device_seconds,
        started_at=started_at,
        finished_at=now_iso(),
        latencies=request_latencies,
        rows_failed=sums["rows_failed"],
        prompt_tokens=sums["prompt_tokens"],
        cached_tokens=sums["cached_tokens"],
        completion_tokens=sums["completion_tokens"],
        reasoning_tokens=sums["reasoning_tokens"],
    )
    try:
        out.write_shard(
            spec.output, table, stats, fmt=spec.part_format, storage_options=spec.storage_options
        )
    except FileExistsError:
        # Another worker published this shard first; its part stands, ours is dropped.
        log.info("shard %s was completed elsewhere meanwhile; keeping that part", shard.shard_id)
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    result = ShardResult(
        shard.shard_id,
        skipped=False,
        num_rows=table.num_rows,
        rows_failed=sums["rows_failed"],
        device_seconds=stats.device_seconds,
        prompt_tokens=sums["prompt_tokens"],
        cached_tokens=sums["cached_tokens"],
        completion_tokens=sums["completion_tokens"],
        reasoning_tokens=sums["reasoning_tokens"],
    )
    log.info(
        "shard %s: %d rows (%d failed), %.2fs",
        shard.shard_id,
        result.num_rows,
        result.rows_failed,
        result.device_seconds,
    )
    return result


def _copies_table(plan: JobPlan, shard: Shard, planned: ShardRows) -> pa.Table:
    """A copy shard's results, from its sources' published parts."""
    spec = plan.spec
    by_id = {s.shard_id: s for s in plan.shards}
    source_ids: dict[int, str] = {}
    parts = []
    for source_shard in dict.fromkeys(s for _, s in planned.sources):
        ids = load_shard(plan, by_id[source_shard], columns=["row_index", "id"])
        source_ids.update(zip(ids["row_index"].to_pylist(), ids["id"].to_pylist()))
        try:
            parts.append(
                out.read_shard_part(
                    spec.output, source_shard, spec.part_format, spec.storage_options
                )
            )
        except FileNotFoundError:
            raise RuntimeError(
                f"copy shard {shard.shard_id} takes answers from shard {source_shard}, "
                "which is not complete: run the job's compute shards first (rerun the job)"
            ) from None
    sources = pa.concat_tables(parts, promote_options="permissive")
    copies = [(row.id, source_ids[index]) for row, (index, _) in zip(planned.rows, planned.sources)]
    return copy_results(
        sources,
        copies,
        task=spec.task,
        extras=plan.result_extras,
        layout=plan.layout,
        passthrough=planned.passthrough,
    )
