"""`batch_inference`: a tokenmill batch job as a Prefect flow.

    plan_task (on a worker) -> prepare_output_task -> shard_task per pending compute shard
                               (each writes the copy shards its part completes)
                            -> shard_task per copy shard still unpublished (dedupe's copies)
                            -> ledger_task (ledger.json, ledger dataset, artifacts)
    with dry_run:   plan_task -> forecast_task (OUTPUT/_forecast.json, artifact)

The flow only orchestrates; every stage is a call into `tokenmill.pipelines`. Its
parameters are the job definition's FLOW options (`pipelines/options.py`), flat and
typed (`flows/parameters.py` derives them), so Prefect validates them (UI forms,
`prefect deployment run -p`, `flow(...)` calls) before the run starts; `JobSpec`
then checks how they combine. Shards fan out over the flow's task runner: threads
by default, a Dask or Ray cluster with `batch_inference.with_options(task_runner=
make_task_runner(...))`.

The flow holds the output's lock (`pipelines/output_lock.py`) from planning to the
ledger, so a second run on the same output is refused. Rerunning the flow with the
same parameters resumes the job: shards whose part is in the output are not
submitted again, and the ledger is rebuilt from all parts.

The plan cuts at least one shard per worker of the task runner (when the job has the
rows), and the run says so when it cannot use every worker. While shards run, the
flow publishes a progress artifact (`tokenmill-progress-<job id>`, `flows/progress.py`)
whenever a shard ends and at least every few seconds.
"""

# No `from __future__ import annotations` here: Prefect reads the flow's signature (built
# from the job definition by `job_parameters`) at run time, in served runs' subprocesses too.
import concurrent.futures
import contextlib
import logging
import time
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from tokenmill.connectors.fs import redact_url
from tokenmill.flows.artifacts import ProgressArtifact, publish_workers
from tokenmill.flows.completions import Completions
from tokenmill.flows.parameters import build_spec, job_parameters
from tokenmill.flows.progress import PUBLISH_EVERY_S, job_snapshot, read_records
from tokenmill.flows.runners import (
    engine_slots,
    make_task_runner,
    num_workers,
    planning_fan_out,
    preload_engines,
    replicate_to_workers,
)
from tokenmill.flows.tasks import (
    ShardRun,
    forecast_task,
    ledger_task,
    plan_task,
    prepare_output_task,
    shard_task,
)
from tokenmill.pipelines import output as out
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.ledger import JobLedger, now_iso
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan
from tokenmill.pipelines.spec import JobSpec

FLOW_NAME = "batch-inference"


def _flow_run_name() -> str:
    # The job id is a hash of the planned shards, unknown until planning; the run is
    # renamed to `job <id> -> <output>` once the plan exists (see `_name_after_plan`).
    return f"tokenmill -> {redact_url(flow_run.parameters['output'])}"


@flow(
    name=FLOW_NAME,
    flow_run_name=_flow_run_name,
    task_runner=make_task_runner(),
    log_prints=False,
)
@job_parameters
def batch_inference(input: str, output: str, **options: Any) -> JobLedger | Forecast:
    """Run a tokenmill batch job: prompts in, results and a token-cost ledger out.

    Args:
        input: dataset URL or path (Parquet, JSON Lines, JSON, CSV, TSV, OpenAI batch;
            any fsspec URL).
            `{date}` / `{datetime}` are replaced by the run's scheduled time (UTC).
        output: output directory URL or path (results parts, ledger.json, ledger/);
            `{date}` / `{datetime}` as for input, so each scheduled run has its own.
        {job options}

    Returns:
        The job's JobLedger (also in OUTPUT/ledger.json and the ledger dataset); with
        dry_run, its Forecast (also in OUTPUT/_forecast.json).
    """
    logger = get_run_logger()
    run_started_at = now_iso()
    scheduled = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    spec = build_spec(input, output, scheduled=scheduled, **options)
    workers = num_workers(FlowRunContext.get().task_runner)
    # One run per output at a time, held by the flow's own process.
    with claimed_output(spec.output, spec.storage_options):
        planned_before = out.planned_shards(spec.output, spec.storage_options)
        if not spec.dry_run and not _resumes(spec):
            # The workers load their engines while the plan is made, not in their first
            # shards: shards then start on loaded engines, all at once. Not on a rerun,
            # which may find every shard done: its shards load what they need.
            preload_engines(FlowRunContext.get().task_runner, spec.llm_options)
        # Submitted, not called: on a cluster the plan then stays on the worker that made
        # it, and each shard task's worker fetches it from there once (not once per shard).
        fan_out = planning_fan_out(FlowRunContext.get().task_runner, workers)
        plan_future = plan_task.submit(spec, min_shards=workers, fan_out=fan_out)
        plan = plan_future.result()
        _name_after_plan(plan, logger)
        if spec.dry_run:
            return forecast_task.submit(plan_future, planned_before=planned_before).result()
        done = prepare_output_task(plan)
        pending = [s for s in plan.shards if s.shard_id not in done]
        compute = [s for s in pending if not s.is_copy]
        logger.info(
            "job %s: %d rows in %d shards; %d already complete, %d to run",
            plan.job_id,
            plan.num_rows,
            len(plan.shards),
            len(plan.shards) - len(pending),
            len(pending),
        )
        if 0 < len(compute) < workers:
            logger.warning(
                "job %s: %d shard(s) to compute for %d workers: %d worker(s) will idle "
                "(the job has too few rows or tokens left to cut more shards)",
                plan.job_id,
                len(compute),
                workers,
                workers - len(compute),
            )
        if workers > 1 and len(compute) > 1:
            replicate_to_workers(FlowRunContext.get().task_runner, plan_future)
        progress = _FlowProgress(plan, pending, logger, workers)
        runs: list[ShardRun] = []
        # Each compute shard task writes the copy shards its part completes (the one
        # that publishes a copy shard's last source), so the copies end with the compute.
        # Copy shards still unpublished then (their sources were complete before this
        # run, or writing them failed there) run as tasks of their own. Compute shards
        # each need an engine slot on a Dask cluster (`flows/runners.py`, "Placement");
        # copy shards read parts and run anywhere.
        copy_shards = [s for s in pending if s.is_copy]
        for shards, placement in ((compute, engine_slots()), (copy_shards, None)):
            if placement is None and shards:
                shards = _unpublished(plan, shards)
            if shards:
                with placement or contextlib.nullcontext():
                    futures = shard_task.map(
                        plan=unmapped(plan_future), shard=shards, job_id=unmapped(plan.job_id)
                    )
                runs += _shard_runs(plan, futures, progress)
        _publish_workers(plan, runs, logger)
        return ledger_task(
            plan,
            run_id=str(flow_run.id),
            run_started_at=run_started_at,
            num_shards_run=shards_run(runs),
        )


def _resumes(spec: JobSpec) -> bool:
    """Whether this run takes up an earlier run's output (its shard cut is recorded)."""
    return spec.resume and out.read_cut(spec.output, spec.storage_options) is not None


def _unpublished(plan: JobPlan, shards: list[Shard]) -> list[Shard]:
    """The shards among `shards` whose part is not in the output (one listing)."""
    spec = plan.spec
    done = out.completed_shards(spec.output, spec.storage_options)
    return [s for s in shards if s.shard_id not in done]


def shards_run(runs: list[ShardRun]) -> int:
    """The shards this run wrote: its tasks' own, and the copy shards they wrote."""
    return sum((not r.result.skipped) + sum(not c.skipped for c in r.copies) for r in runs)


def _name_after_plan(plan: JobPlan, logger: logging.LoggerAdapter) -> None:
    """Rename the running flow run after its job id (best effort: a name is cosmetic)."""
    from prefect import get_client

    name = f"job {plan.job_id} -> {redact_url(plan.spec.output)}"
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:  # the run goes on under its first name
        logger.warning("could not rename the flow run to %r: %s", name, exc)


def worker_rows(runs: list[ShardRun]) -> list[dict[str, Any]]:
    """Per worker: the shards it computed, and the engine loads they paid and their
    seconds (0 on a warm worker: its engine came from an earlier shard or flow run)."""
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.result.skipped:
            continue
        row = rows.setdefault(
            run.worker, {"worker": run.worker, "shards": 0, "engine loads": 0, "load s": 0.0}
        )
        row["shards"] += 1
        if run.engine_load_seconds is not None:
            row["engine loads"] += 1
            row["load s"] = round(row["load s"] + run.engine_load_seconds, 3)
    return sorted(rows.values(), key=lambda row: row["worker"])


def _publish_workers(plan: JobPlan, runs: list[ShardRun], logger: logging.LoggerAdapter) -> None:
    rows = worker_rows(runs)
    for row in rows:
        logger.info(
            "worker %s: %d shard(s), %d engine load(s), %.2f s loading",
            row["worker"],
            row["shards"],
            row["engine loads"],
            row["load s"],
        )
    try:
        publish_workers(plan.job_id, rows)
    except Exception as exc:  # a report for people; the job's results are written
        logger.warning("could not publish the workers artifact: %s", exc)


class _FlowProgress:
    """Publishes the job's progress artifact from the shards' progress records."""

    def __init__(
        self, plan: JobPlan, pending: list[Shard], logger: logging.LoggerAdapter, workers: int
    ):
        self.plan, self.pending, self.logger, self.workers = plan, pending, logger, workers
        self.artifact = ProgressArtifact(plan.job_id)

    def publish(self) -> None:
        records = read_records(self.plan)
        snapshot = job_snapshot(
            self.plan, self.pending, records, now=time.time(), workers=self.workers
        )
        try:
            self.artifact.update(snapshot)
        except Exception as exc:  # progress is for people; the job goes on
            self.logger.warning("could not update the progress artifact: %s", exc)


def _shard_runs(plan: JobPlan, futures: list, progress: _FlowProgress) -> list[ShardRun]:
    """Wait for every shard, publishing progress as each ends and at least every
    `PUBLISH_EVERY_S`, then fail if any failed.

    All shards are waited for before failing, so one bad shard does not cancel the
    work of the others: their parts are kept, and a rerun computes only what failed.
    Publishing runs between waits, never inside a timeout scope (`flows/completions.py`).
    """
    waiting = Completions(futures)
    progress.publish()
    while waiting.pending:
        waiting.wait(PUBLISH_EVERY_S)
        progress.publish()
    runs: list[ShardRun] = []
    failed: list[str] = []
    cancelled: list[str] = []
    for shard_future in futures:
        try:
            # wait() takes the final state from the task runner's own future; `state` alone
            # may read the API's copy, which can lag behind a task that has just finished.
            shard_future.wait()
            state = shard_future.state
            if state.is_completed():
                runs.append(shard_future.result())
            else:
                failed.append(state.name or "failed")
        except concurrent.futures.CancelledError as exc:
            # A Dask client that loses its scheduler cancels every future it holds
            # ("scheduler-connection-lost"), whatever its shard had done: parts already
            # published are kept, so the job is resumable, not lost.
            cancelled.append(str(exc).splitlines()[0])
    if cancelled:
        raise RuntimeError(
            f"job {plan.job_id}: {len(cancelled)} of {len(futures)} shard tasks were cancelled "
            f"by the task runner ({cancelled[0]}); a Dask scheduler that was lost or restarted "
            "cancels everything submitted to it. Completed shards are kept: run the flow "
            "again with the same parameters to finish the job."
        )
    if failed:
        raise RuntimeError(
            f"job {plan.job_id}: {len(failed)} of {len(futures)} shard tasks did not complete; "
            "their errors are in the task runs' logs. Completed shards are kept: run the flow "
            "again with the same parameters to finish the job."
        )
    return runs
