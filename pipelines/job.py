"""A batch job in three separately callable steps: plan, run shards, finalize.

    plan_job(spec)             read + template + tokenize + shard, window by window,
                               writing each shard's rows to OUTPUT/_plan/; every input
                               problem raises here, before the model is loaded
                               (pipelines/planning.py)
    run_shard(llm, plan, s)    read one shard's rows, generate, publish its part;
                               idempotent (pipelines/running.py)
    finalize_job(plan, ...)    check the parts one by one, write the ledger, drop _plan/
                               (pipelines/finalizing.py)

`run_job` composes them; the Prefect flows call them as separate tasks, so their
inputs and outputs are plain picklable dataclasses. With `dry_run` it plans and
forecasts instead (`pipelines/dry_run.py`). Prompts and outputs are never logged -
only counts.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any

from tokenmill.connectors.fs import redact_url
from tokenmill.engine import RequestOutput
from tokenmill.pipelines import output as out
from tokenmill.pipelines.dry_run import dry_run
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.ledger import JobLedger, now_iso
from tokenmill.pipelines.option_types import JOB
from tokenmill.pipelines.options import check_names, takes_options
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, load_shard, plan_job
from tokenmill.pipelines.progress import StepTokens, step_counter
from tokenmill.pipelines.running import (
    ShardResult,
    completed_shards,
    prepare_output,
    run_shard,
)
from tokenmill.pipelines.spec import JobSpec

log = logging.getLogger(__name__)

__all__ = [
    "Forecast",
    "JobPlan",
    "JobProgress",
    "JobSpec",
    "ShardResult",
    "finalize_job",
    "load_shard",
    "plan_job",
    "prepare_output",
    "run_job",
    "run_shard",
]


class JobProgress:
    """Hooks `run_job` calls as it goes; override any of them (e.g. a progress bar)."""

    def stage(self, message: str) -> None:
        """A stage begins: planning, loading the model, calibrating, writing the ledger."""

    def planned(self, plan: JobPlan, pending: list[Shard]) -> None:
        """The plan is ready and the model loaded; `pending` shards will be computed."""

    def warn(self, message: str) -> None:
        """Something the user must hear of, whatever else is shown (an empty input)."""
        log.warning(message)

    def step(self, tokens: StepTokens) -> None:
        """One engine step's tokens (prompt tokens computed or cached, tokens generated)."""

    def request_done(self, output: RequestOutput) -> None:
        """One request finished."""

    def shard_done(self, result: ShardResult) -> None:
        """One shard's part is published."""


@takes_options(JOB)
def run_job(
    input: str,
    output: str,
    *,
    llm: Any = None,
    progress: JobProgress | None = None,
    **options: Any,
) -> JobLedger | Forecast:
    """Run a batch job end to end: plan, compute the missing shards, write the ledger.

    Rerunning the same job into the same output resumes it: complete shards are
    skipped, and the results hold exactly one row per input row. The run holds the
    output's lock throughout (`claimed_output`): a second run on the same output is
    refused, and temporary files a killed run left behind are removed first.

    With `dry_run=True` nothing is computed: the job is planned and forecast
    (`pipelines/forecast.py`; calibrated on a sample of its rows unless
    `calibrate=False`), the forecast is recorded in `OUTPUT/_forecast.json` for the
    ledger to show beside the actuals, and returned.

    Args:
        input: dataset URL or path.
        output: output directory URL or path.
        llm: an already loaded LLM to use (default: the process's shared engine for
            the job's model and engine options, `engine.llm_cache`).
        progress: hooks for progress reporting.
        **options: the job options (model, template, max_tokens, temperature,
            price_input, shard_tokens, storage_options, resume, ...): every JOB option
            of `pipelines/options.py`, as the signature lists them.

    Returns:
        The JobLedger; with dry_run, the Forecast.

    Raises:
        OutputLockedError: another run is writing to `output`.
        DiskFullError: the output's filesystem is full; rerun once space is freed.
    """
    check_names(options, surface=JOB)  # a clearer error than JobSpec's own TypeError
    spec = JobSpec(input, output, **options)
    progress = progress or JobProgress()
    run_started_at = now_iso()
    with claimed_output(spec.output, spec.storage_options):
        progress.stage(f"planning {redact_url(spec.input)}")
        if spec.dry_run:
            return _dry_run(spec, llm, progress)
        plan = plan_job(spec, llm=llm)
        if plan.empty_warning:
            progress.warn(plan.empty_warning)
        done = prepare_output(plan)
        pending = [s for s in plan.shards if s.shard_id not in done]
        llm_lock: Any = nullcontext()
        if any(not s.is_copy for s in pending) and llm is None:
            progress.stage(f"loading model {plan.model_name}")
            shared = _shared_llm(spec)
            llm, llm_lock = shared.llm, shared.lock
        progress.planned(plan, pending)
        with llm_lock:
            stats = getattr(llm, "stats", None)
            tokens = step_counter(stats() if stats is not None else None)
            for shard in pending:
                result = run_shard(
                    llm,
                    plan,
                    shard,
                    on_output=progress.request_done,
                    on_step=lambda engine_stats: progress.step(tokens(engine_stats)),
                )
                progress.shard_done(result)
        progress.stage("writing the ledger")
        return finalize_job(plan, run_started_at=run_started_at, num_shards_run=len(pending))


def _shared_llm(spec: JobSpec) -> Any:
    from tokenmill.pipelines.shared_llm import get_llm

    return get_llm(**spec.llm_options)


def _dry_run(spec: JobSpec, llm: Any, progress: JobProgress) -> Forecast:
    """Plan and forecast the job (see `run_job`); the caller holds the output's lock."""
    planned_before = out.planned_shards(spec.output, spec.storage_options)
    started = time.perf_counter()
    plan = plan_job(spec, llm=llm)
    planning_seconds = time.perf_counter() - started
    if plan.empty_warning:
        progress.warn(plan.empty_warning)
    try:
        done = completed_shards(plan)
    except ValueError:
        added = [s.shard_id for s in plan.shards if s.shard_id not in planned_before]
        out.remove_plan(spec.output, spec.storage_options, shard_ids=added)
        raise
    progress.planned(plan, [])
    lock: Any = nullcontext()
    computes = any(not s.is_copy and s.shard_id not in done for s in plan.shards)
    if spec.calibrate and computes and llm is None:
        progress.stage(f"loading model {plan.model_name}")
        shared = _shared_llm(spec)
        llm, lock = shared.llm, shared.lock
    if spec.calibrate and computes:
        progress.stage("calibrating on a sample of the job's rows")
    with lock:
        forecast = dry_run(
            plan,
            done=done,
            planned_before=planned_before,
            llm=llm if spec.calibrate else None,
            planning_seconds=planning_seconds,
        )
    return forecast
