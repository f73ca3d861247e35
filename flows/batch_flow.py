"""`batch_inference`: a tokenmill batch job as a Prefect flow.

    plan_task (on a worker) -> prepare_output_task -> shard_task per pending shard
                            -> ledger_task (ledger.json, ledger dataset, artifacts)

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
"""

# No `from __future__ import annotations` here: Prefect reads the flow's signature (built
# from the job definition by `job_parameters`) at run time, in served runs' subprocesses too.
import logging
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.futures import wait
from prefect.runtime import flow_run

from tokenmill.connectors.fs import redact_url
from tokenmill.flows.parameters import build_spec, job_parameters
from tokenmill.flows.runners import make_task_runner
from tokenmill.flows.tasks import (
    ShardRun,
    ledger_task,
    plan_task,
    prepare_output_task,
    shard_task,
)
from tokenmill.pipelines.ledger import JobLedger, now_iso
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.planning import JobPlan

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
def batch_inference(input: str, output: str, **options: Any) -> JobLedger:
    """Run a tokenmill batch job: prompts in, results and a token-cost ledger out.

    Args:
        input: dataset URL or path (Parquet, JSONL, CSV, OpenAI batch; any fsspec URL).
            `{date}` / `{datetime}` are replaced by the run's scheduled time (UTC).
        output: output directory URL or path (results parts, ledger.json, ledger/);
            `{date}` / `{datetime}` as for input, so each scheduled run has its own.
        {job options}

    Returns:
        The job's JobLedger (also in OUTPUT/ledger.json and the ledger dataset).
    """
    logger = get_run_logger()
    run_started_at = now_iso()
    scheduled = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    spec = build_spec(input, output, scheduled=scheduled, **options)
    # One run per output at a time, held by the flow's own process.
    with claimed_output(spec.output, spec.storage_options):
        # Submitted, not called: on a cluster the plan then stays on the worker that made
        # it, and each shard task's worker fetches it from there once (not once per shard).
        plan_future = plan_task.submit(spec)
        plan = plan_future.result()
        _name_after_plan(plan, logger)
        done = prepare_output_task(plan)
        pending = [s for s in plan.shards if s.shard_id not in done]
        logger.info(
            "job %s: %d rows in %d shards; %d already complete, %d to run",
            plan.job_id,
            plan.num_rows,
            len(plan.shards),
            len(plan.shards) - len(pending),
            len(pending),
        )
        futures = shard_task.map(
            plan=unmapped(plan_future), shard=pending, job_id=unmapped(plan.job_id)
        )
        runs = _shard_runs(plan, futures)
        return ledger_task(
            plan,
            run_id=str(flow_run.id),
            run_started_at=run_started_at,
            num_shards_run=sum(1 for r in runs if not r.result.skipped),
        )


def _name_after_plan(plan: JobPlan, logger: logging.LoggerAdapter) -> None:
    """Rename the running flow run after its job id (best effort: a name is cosmetic)."""
    from prefect import get_client

    name = f"job {plan.job_id} -> {redact_url(plan.spec.output)}"
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:  # the run goes on under its first name
        logger.warning("could not rename the flow run to %r: %s", name, exc)


def _shard_runs(plan: JobPlan, futures: list) -> list[ShardRun]:
    """Wait for every shard, then fail if any failed.

    All shards are waited for before failing, so one bad shard does not cancel the
    work of the others: their parts are kept, and a rerun computes only what failed.
    """
    wait(futures)
    runs: list[ShardRun] = []
    failed: list[str] = []
    for shard_future in futures:
        state = shard_future.state
        if state.is_completed():
            runs.append(shard_future.result())
        else:
            failed.append(state.name or "failed")
    if failed:
        raise RuntimeError(
            f"job {plan.job_id}: {len(failed)} of {len(futures)} shard tasks did not complete; "
            "their errors are in the task runs' logs. Completed shards are kept: run the flow "
            "again with the same parameters to finish the job."
        )
    return runs
