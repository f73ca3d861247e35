"""Running a planned job's shards: check the output, then generate (or score) shard by shard.

A shard is done when its results part exists; parts are published atomically and
never overwritten, so `run_shard` is idempotent: a retried, resumed or duplicated
shard task finds the part and computes nothing. An engine failure mid-shard is
handled by the one rule of `pipelines/engine_failures.py` (retry once, then isolate
the failing requests as error rows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.outputs import RequestOutput
from tokenmill.pipelines import output as out
from tokenmill.pipelines.adapters import adapter_names
from tokenmill.pipelines.engine_failures import generate_with_rule
from tokenmill.pipelines.ledger import ShardStats, now_iso
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, load_shard
from tokenmill.pipelines.results import build_results, extra_columns, latencies
from tokenmill.pipelines.spill import shard_rows

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]


@dataclass
class ShardResult:
    """What running one shard did (counts only; token sums come from the parts)."""

    shard_id: str
    skipped: bool  # already complete: nothing was computed
    num_rows: int
    rows_failed: int = 0
    device_seconds: float = 0.0


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
        done: set[str] = set()
    else:
        done = out.completed_shards(spec.output, spec.storage_options)
        foreign = sorted(done - {s.shard_id for s in plan.shards})
        if foreign:
            raise ValueError(
                f"{out.results_uri(spec.output)} holds {len(foreign)} part(s) that are not "
                f"shards of this job (e.g. {foreign[0]}): the input, model or options changed "
                "since they were written. Use a new output location, or resume=False "
                "(--no-resume) to replace them."
            )
    # Recorded before any part of this input is published (planning checked it).
    out.write_input_fingerprint(spec.output, plan.input_fingerprint, spec.storage_options)
    return done


def run_shard(
    llm: Any, plan: JobPlan, shard: Shard, *, on_output: OnOutput | None = None
) -> ShardResult:
    """Generate one shard's rows and publish its results part.

    Idempotent: a shard whose part already exists is skipped, so a retried or resumed
    task never computes or writes a shard twice.

    Args:
        llm: a loaded `tokenmill.engine.llm.LLM` (anything with its `generate`); the
            caller holds its lock if other threads share it.
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
    outputs = generate_with_rule(
        llm,
        good,
        plan.params,
        shard_id=shard.shard_id,
        on_output=on_output,
        loras=plan.lora_requests,
    )
    seconds = time.perf_counter() - t0
    table = build_results(
        rows,
        outputs,
        passthrough=planned.passthrough,
        task=spec.task,
        extras=extra_columns(plan.params, has_adapters=bool(plan.adapters)),
        adapters=adapter_names(plan.adapters),
        layout=plan.layout,
    )
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
    result = ShardResult(
        shard.shard_id,
        skipped=False,
        num_rows=len(rows),
        rows_failed=sum(1 for r in table["finish_reason"].to_pylist() if r == "error"),
        device_seconds=stats.device_seconds,
    )
    log.info(
        "shard %s: %d rows (%d failed), %.2fs",
        shard.shard_id,
        result.num_rows,
        result.rows_failed,
        result.device_seconds,
    )
    return result
