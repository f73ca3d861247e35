"""The batch flow's tasks, one per stage; each calls the pipeline and adds only orchestration.

    plan_task            read + template + tokenize + shard;  (I/O: retried on transient errors)
                         each shard's rows go to OUTPUT/_plan/
    prepare_output_task  which shards are already complete    (I/O: retried)
    shard_task           read its rows, generate, write part  (I/O: retried; idempotent)
    ledger_task          check parts, write ledger, artifacts (I/O: retried)

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
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.runtime import task_run

from tokenmill.connectors.fs import redact_url
from tokenmill.flows.artifacts import publish_ledger
from tokenmill.flows.retries import RETRY_DELAYS_S, retry_shard, retry_transient
from tokenmill.pipelines import output as out
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.ledger import JobLedger
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, plan_job
from tokenmill.pipelines.running import ShardResult, prepare_output, run_shard
from tokenmill.pipelines.spec import JobSpec


@dataclass(frozen=True)
class ShardRun:
    """A shard task's result: the pipeline's ShardResult and where it ran."""

    result: ShardResult
    host: str
    pid: int
    engine_loads: int  # engines this worker process had loaded when the shard finished

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
    retries=len(RETRY_DELAYS_S),
    retry_delay_seconds=RETRY_DELAYS_S,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def plan_task(spec: JobSpec) -> JobPlan:
    """Read, template, tokenize and shard the input; bad input fails here, before compute."""
    return plan_job(spec)


@task(
    task_run_name="prepare-output job-{plan.job_id}",
    retries=len(RETRY_DELAYS_S),
    retry_delay_seconds=RETRY_DELAYS_S,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def prepare_output_task(plan: JobPlan) -> set[str]:
    """The ids of the shards already complete in the output (or none, with resume off)."""
    return prepare_output(plan)


@task(
    task_run_name="job-{job_id} shard-{shard.shard_id}",
    retries=len(RETRY_DELAYS_S),
    retry_delay_seconds=RETRY_DELAYS_S,
    retry_condition_fn=retry_shard,
    cache_policy=NO_CACHE,
)
def shard_task(plan: JobPlan, shard: Shard, job_id: str) -> ShardRun:
    """Generate one shard and publish its part, on this process's shared engine.

    Idempotent: a shard whose part exists is skipped (`ShardResult.skipped`), so a
    retry, a rerun or a second flow run on the same job never writes it twice.

    Args:
        plan: the job plan (names and sizes of shards; the rows are read here).
        shard: one of `plan.shards`.
        job_id: the plan's job id (a parameter so that the task run's name shows it).
    """
    # One engine per worker process, loaded on its first shard and reused by the rest
    # (pipelines/shared_llm.py); the lock keeps this process's shard tasks from generating
    # at once, since the engine is not thread-safe.
    engine = llm_cache.get_llm(**plan.spec.llm_options)
    if engine.weights_hash != plan.weights_hash:
        # A remote worker resolved the model name to other files than the planner did.
        raise RuntimeError(
            f"worker {socket.gethostname()}:{os.getpid()} loaded model {plan.model_name!r} "
            f"with weights {engine.weights_hash[:12]}, but job {job_id} was planned with "
            f"{plan.weights_hash[:12]}: give every worker the same model files"
        )
    with engine.lock:
        result = run_shard(engine.llm, plan, shard)
    run = ShardRun(result, socket.gethostname(), os.getpid(), llm_cache.num_loads())
    # Where each shard ran, in the task run's log: counts and names only, never text.
    _logger().info(
        "shard %s: %d rows, %s on worker %s (engines loaded by this worker: %d)",
        shard.shard_id,
        result.num_rows,
        "already complete, skipped" if result.skipped else f"{result.device_seconds:.2f} s",
        run.worker,
        run.engine_loads,
    )
    return run


@task(
    task_run_name="ledger job-{plan.job_id}",
    retries=len(RETRY_DELAYS_S),
    retry_delay_seconds=RETRY_DELAYS_S,
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
