"""The batch flow's tasks, one per stage; each calls the pipeline and adds only orchestration.

    plan_task            read + template + tokenize + shard;  (I/O: retried on transient errors)
                         each shard's rows go to OUTPUT/_plan/
    prepare_output_task  which shards are already complete    (I/O: retried)
    shard_task           read its rows, generate, write part  (I/O: retried; idempotent)
                         then the copy shards whose sources are now all published
    ledger_task          check parts, write ledger, artifacts (I/O: retried)
    forecast_task        a dry run: forecast, OUTPUT/_forecast.json, artifact (I/O: retried)

None of them uses Prefect's result cache (`NO_CACHE`): a job's progress lives in its
output directory - a shard is done iff its part exists - which survives a killed
flow, a new flow run and a different Prefect server alike.

A JobPlan passed between tasks is small - shard names and sizes, not rows - so the
fan-out ships the same few kilobytes to every worker whatever the dataset's size;
each shard task reads its own rows from the shard's plan file in the output.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.runtime import task_run

from tokenmill.connectors.fs import redact_url
from tokenmill.flows.artifacts import publish_forecast, publish_ledger
from tokenmill.flows.progress import ShardReporter, shard_line
from tokenmill.flows.retries import (
    NUM_RETRIES,
    RETRY_DELAY_S,
    RETRY_JITTER,
    retry_shard,
    retry_transient,
)
from tokenmill.flows.runners import DaskFanOut, worker_threads
from tokenmill.pipelines import output as out
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.dry_run import dry_run
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.ledger import JobLedger
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, plan_job
from tokenmill.pipelines.running import (
    ShardResult,
    completed_shards,
    copies_ready,
    prepare_output,
    run_shard,
)
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spread_planning import plan_job_spread

RETRIES = {
    "retries": NUM_RETRIES,
    "retry_delay_seconds": RETRY_DELAY_S,
    "retry_jitter_factor": RETRY_JITTER,
}


@dataclass(frozen=True)
class ShardRun:
    """A shard task's result: the pipeline's ShardResult and where it ran."""

    result: ShardResult
    host: str
    pid: int
    engine_loads: int  # engines this worker process had loaded when the shard finished
    # Seconds its worker's engine took to load, reported by the first shard to use it
    # (the load itself may have run while the flow planned); None when the engine was
    # warm or the shard needs none.
    engine_load_seconds: float | None = None
    # The copy shards this task wrote after its own part, their sources being complete.
    copies: tuple[ShardResult, ...] = ()

    @property
    def worker(self) -> str:
        return f"{self.host}:{self.pid}"


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (shipped to the Prefect API); a plain one under `task.fn`."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _plan_run_name() -> str:
    spec = task_run.parameters["spec"]
    return f"plan {redact_url(spec.input)}"


# The plan holds the storage options (credentials included): it stays in memory, never
# in Prefect's result storage.
@task(
    task_run_name=_plan_run_name,
    **RETRIES,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def plan_task(spec: JobSpec, min_shards: int = 1, fan_out: DaskFanOut | None = None) -> JobPlan:
    """Read, template, tokenize and shard the input; bad input fails here, before compute.

    Args:
        spec: the job.
        min_shards: cut at least this many shards where the rows allow: one per worker.
        fan_out: read, template and tokenize in parts on a Dask cluster's workers (the
            same plan: `pipelines/spread_planning.py`); None: in this task.
    """
    if fan_out is not None:
        plan = plan_job_spread(spec, fan_out=fan_out, min_shards=min_shards)
    else:
        plan = plan_job(spec, min_shards=min_shards)
    if plan.empty_warning:
        _logger().warning(plan.empty_warning)
    return plan


@task(
    task_run_name="prepare-output job-{plan.job_id}",
    **RETRIES,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def prepare_output_task(plan: JobPlan) -> set[str]:
    """The ids of the shards already complete in the output (or none, with resume off)."""
    return prepare_output(plan)


@task(
    task_run_name="job-{job_id} shard-{shard.shard_id}",
    **RETRIES,
    retry_condition_fn=retry_shard,
    cache_policy=NO_CACHE,
)
def shard_task(plan: JobPlan, shard: Shard, job_id: str) -> ShardRun:
    """Generate one shard and publish its part, on this process's shared engine.

    Idempotent: a shard whose part exists is skipped (`ShardResult.skipped`), so a
    retry, a rerun or a second flow run on the same job never writes it twice.

    A compute shard then writes the copy shards its part completes (`copies_ready`):
    the task that publishes a copy shard's last source writes it at once, instead of
    a copy task queued after every compute shard, which would add a scheduling round
    and the copies' own seconds to the job's end.

    Args:
        plan: the job plan (names and sizes of shards; the rows are read here).
        shard: one of `plan.shards`.
        job_id: the plan's job id (a parameter so that the task run's name shows it).
    """
    logger = _logger()
    llm, load_seconds = None, None
    if not shard.is_copy:  # a copy shard reads its sources' parts: no engine
        llm, loaded = _worker_llm(plan, job_id)
        load_seconds = llm.load_seconds if loaded else None
    with llm.lock if llm else nullcontext():
        # Counted from the engine's counters as this shard starts: under the lock, after
        # any other shard of this process has finished with the engine.
        reporter = ShardReporter(plan, shard, logger, before=llm.llm.stats() if llm else None)
        started = time.perf_counter()
        result = run_shard(
            llm.llm if llm else None,
            plan,
            shard,
            on_output=reporter.request_done,
            on_step=reporter.step,
        )
    seconds = time.perf_counter() - started
    snapshot = reporter.finish(result)
    copies = () if shard.is_copy else _run_ready_copies(plan, shard, logger)
    run = ShardRun(
        result, socket.gethostname(), os.getpid(), llm_cache.num_loads(), load_seconds, copies
    )
    # Where each shard ran, in the task run's log: counts and names only, never text.
    if result.skipped:
        logger.info("shard %s: already complete, skipped (worker %s)", shard.shard_id, run.worker)
    else:
        logger.info(
            "shard %s: %s on worker %s (engines loaded by this worker: %d, compute threads: %d)",
            shard.shard_id,
            shard_line(result, result.device_seconds or seconds, snapshot.cost),
            run.worker,
            run.engine_loads,
            torch.get_num_threads(),
        )
    return run


def _run_ready_copies(
    plan: JobPlan, shard: Shard, logger: logging.Logger | logging.LoggerAdapter
) -> tuple[ShardResult, ...]:
    """Write the copy shards that `shard`'s published part completes. A copy shard that
    fails here is left to the flow, which runs every copy shard still unpublished once
    the compute shards end (and fails there, naming it, if it fails again)."""
    results = []
    for copy in copies_ready(plan, shard):
        reporter = ShardReporter(plan, copy, logger)
        try:
            result = run_shard(None, plan, copy)
        except Exception as exc:
            logger.warning("copy shard %s: left to the flow: %s", copy.shard_id, exc)
            continue
        reporter.finish(result)
        if not result.skipped:
            logger.info(
                "copy shard %s: %d rows, written after shard %s",
                copy.shard_id,
                result.num_rows,
                shard.shard_id,
            )
        results.append(result)
    return tuple(results)


def _worker_llm(plan: JobPlan, job_id: str) -> tuple[llm_cache.SharedLLM, bool]:
    """This worker's engine for the job, and whether it was loaded for this call: one per
    worker process, loaded while the flow planned (`preload_engines`) or on its first
    shard, and reused by the rest and by later jobs with the same model and settings
    (pipelines/shared_llm.py), computing on the cores the worker owns; its lock keeps
    this process's shard tasks from generating at once, since the engine is not
    thread-safe."""
    threads = worker_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    engine, loaded = llm_cache.acquire_llm(**plan.spec.llm_options)
    if engine.weights_hash != plan.weights_hash:
        # A remote worker resolved the model name to other files than the planner did.
        raise RuntimeError(
            f"worker {socket.gethostname()}:{os.getpid()} loaded model {plan.model_name!r} "
            f"with weights {engine.weights_hash[:12]}, but job {job_id} was planned with "
            f"{plan.weights_hash[:12]}: give every worker the same model files"
        )
    return engine, loaded


@task(
    task_run_name="ledger job-{plan.job_id}",
    **RETRIES,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def ledger_task(
    plan: JobPlan, *, run_id: str, run_started_at: str, num_shards_run: int
) -> JobLedger:
    """Combine the parts into the ledger, write it, and publish it as artifacts.

    Args:
        plan: the job plan.
        run_id: this flow run's id (recorded in the ledger).
        run_started_at: when this flow run started (ISO 8601).
        num_shards_run: shards this run computed (the rest were already complete).
    """
    ledger = finalize_job(
        plan, run_id=run_id, run_started_at=run_started_at, num_shards_run=num_shards_run
    )
    spec = plan.spec
    publish_ledger(
        ledger,
        results_uri=redact_url(out.results_uri(spec.output)),
        ledger_uri=redact_url(out.join(spec.output, out.LEDGER_FILE)),
    )
    return ledger


@task(
    task_run_name="forecast job-{plan.job_id}",
    **RETRIES,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def forecast_task(plan: JobPlan, *, planned_before: set[str]) -> Forecast:
    """A dry run: forecast the planned job (calibrated on this worker's engine unless
    calibrate is off), record it in OUTPUT/_forecast.json, publish it as an artifact.

    Args:
        plan: the job plan.
        planned_before: the plan files in the output before this run planned (kept).
    """
    spec = plan.spec
    done = completed_shards(plan)
    computes = any(not s.is_copy and s.shard_id not in done for s in plan.shards)
    engine = _worker_llm(plan, plan.job_id)[0] if spec.calibrate and computes else None
    with engine.lock if engine else nullcontext():
        forecast = dry_run(
            plan, done=done, planned_before=planned_before, llm=engine.llm if engine else None
        )
    publish_forecast(forecast)
    return forecast
