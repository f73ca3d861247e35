"""A dry run: a planned job's forecast, with nothing computed and nothing kept but it.

    forecast_job(plan, done)   the Forecast of a planned job (`pipelines/forecast.py`):
                               its finished shards' tokens from their parts, the rest
                               forecast from the plan files; calibrated on `llm` if given
    dry_run(plan, ...)         forecast_job, then record the forecast as
                               OUTPUT/_forecast.json (which the job's ledger later shows
                               beside the actuals) and drop the plan files it planned

The output is left as the dry run found it, but for `_forecast.json`: no results, no
stats, no input fingerprint; plan files another run left are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from tokenmill.engine import PlannedRequest
from tokenmill.pipelines import output as out
from tokenmill.pipelines.forecast import Forecast, Work, engine_planner, forecast_work
from tokenmill.pipelines.ledger import add_token_sums
from tokenmill.pipelines.planning import JobPlan, load_shard
from tokenmill.pipelines.spill import shard_rows

log = logging.getLogger(__name__)


def forecast_job(plan: JobPlan, *, done: Iterable[str] = (), llm: Any = None) -> Forecast:
    """The forecast of a planned job.

    Args:
        plan: the job plan (its plan files must exist).
        done: ids of the shards already complete in the output.
        llm: a loaded LLM to calibrate on; None gives the exact and bounded figures only.

    Returns:
        The Forecast.
    """
    spec = plan.spec
    done = set(done)
    batches = []
    shard_calls = []
    sums = None
    image_tokens = 0
    for shard in plan.shards:
        if shard.shard_id in done:
            part = out.read_shard_part(
                spec.output, shard.shard_id, spec.part_format, spec.storage_options
            )
            sums = add_token_sums(sums, part)
        elif not shard.is_copy:
            rows = shard_rows(load_shard(plan, shard)).rows
            image_tokens += sum(
                r.token_ids.count(plan.image_token_id) for r in rows if r.error is None and r.images
            )
            requests = [
                PlannedRequest(r.token_ids, plan.params[r.params_index])
                for r in rows
                if r.error is None
            ]
            # A shard runs its generation rows in one call, then its pooling rows in
            # another (`engine_failures.generate_rows`): the forecast sees both in order.
            calls = [
                call
                for call in (
                    [r for r in requests if not r.is_pooling],
                    [r for r in requests if r.is_pooling],
                )
                if call
            ]
            batches += calls
            shard_calls.append(calls)
    work = Work(
        batches,
        rows=plan.num_rows,
        rows_failed=plan.num_failed,
        rows_deduplicated=plan.rows_deduplicated,
        shards=len(plan.shards),
        shards_done=len(done & {s.shard_id for s in plan.shards}),
        done_sums=sums,
        # Shards of a job cut for several workers may each start on a cold cache.
        shard_calls=shard_calls if plan.min_shards > 1 else None,
    )
    forecast = forecast_work(
        work,
        planner=engine_planner(spec.llm_options, plan.model_dir, llm),
        prices=spec.prices,
        task=spec.task,
        model=plan.model_name,
        job_id=plan.job_id,
        llm=llm,
    )
    forecast.image_tokens = image_tokens + (sums or {}).get("image_tokens", 0)
    return forecast


def dry_run(
    plan: JobPlan,
    *,
    done: Iterable[str],
    planned_before: set[str],
    llm: Any = None,
    planning_seconds: float | None = None,
) -> Forecast:
    """Forecast a planned job, record the forecast, and drop the plan files it made.

    Args:
        plan: the job plan.
        done: ids of the shards already complete in the output.
        planned_before: ids of the plan files in the output before this dry run planned
            (another run's: they are kept).
        llm: a loaded LLM to calibrate on (None: no calibration).
        planning_seconds: how long planning took (recorded in the forecast).

    Returns:
        The Forecast, also written to `OUTPUT/_forecast.json`.
    """
    spec = plan.spec
    try:
        forecast = forecast_job(plan, done=done, llm=llm)
        forecast.planning_seconds = planning_seconds
        out.write_forecast(spec.output, forecast.to_dict(), spec.storage_options)
    finally:
        added = [s.shard_id for s in plan.shards if s.shard_id not in planned_before]
        out.remove_plan(spec.output, spec.storage_options, shard_ids=added)
    log.info(
        "job %s forecast: %d prompt tokens (%d cached), %d-%d completion tokens",
        plan.job_id,
        forecast.prompt_tokens,
        forecast.cached_tokens,
        forecast.completion_tokens_min,
        forecast.completion_tokens_max,
    )
    return forecast
