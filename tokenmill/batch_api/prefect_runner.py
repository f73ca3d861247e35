"""`--runner prefect`: each batch is a flow run of the existing batch-inference flow.

The server validates a batch as always, then creates a run of the deployment it was
given (`batch-inference/NAME`, registered by the team: `examples/prefect.yaml`, or
`tokenmill serve`-style serving), with the batch's job as the flow's parameters - so the
team's Prefect workers, and the Dask or Ray cluster their flow uses, do the work. In the
Prefect UI a batch's run is tagged with the batch id (and `batch-api`), and the flow
names it after its job once planned (`job <id> -> STORE/batches/<batch id>`). The flow
holds the job's output lock and writes its results, ledger and OpenAI batch output; the
server watches the run, counts finished rows from the published parts, and cuts the
output and error files when the run completes.

- A failed or crashed run is started again once (a new run resumes from the published
  parts); a second failure fails the batch with the run's message.
- Cancel and expiry cancel the run, wait for it to end, then answer the shards it did
  not finish with error lines here (the job's own stages, on the server) and finalize.
- A restarted server finds each batch's run by the id it recorded, and watches it again.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.batch_api.database import now
from tokenmill.batch_api.jobs import job_options, job_spec, stop_pending
from tokenmill.batch_api.runner import CANCELLING, FINALIZING, RUNNING, Active, Runner
from tokenmill.cli.flow import flow_parameters
from tokenmill.pipelines import output as out
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.planning import plan_job

log = logging.getLogger(__name__)

MAX_RUNS = 2  # a run that fails is started again once


class PrefectRunner(Runner):
    """Batches as flow runs of `settings.prefect_deployment`."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self._runs: dict[str, int] = {}  # batch id -> runs started by this server
        self._cancelled: set[str] = set()

    holds_output = False  # the flow run holds the output's lock; the server watches it

    def start_job(self, active: Active, spec: Any) -> None:
        active.flow_run_id = active.batch["flow_run_id"]
        if active.flow_run_id is None and active.batch["status"] != CANCELLING:
            self._submit(active)

    def _submit(self, active: Active) -> None:
        from prefect.deployments import run_deployment

        options = job_options(self.state, active.batch)
        spec = job_spec(self.state, active.batch)
        parameters = flow_parameters(spec.input, spec.output, options)
        flow_run = run_deployment(
            self.state.settings.prefect_deployment,
            parameters=parameters,
            timeout=0,  # created, not waited for: the runner watches it
            flow_run_name=f"batch {active.id}",
            tags=["tokenmill", "batch-api", active.id],
        )
        active.flow_run_id = str(flow_run.id)
        self._runs[active.id] = self._runs.get(active.id, 0) + 1
        self.state.db.update_batch(active.id, flow_run_id=active.flow_run_id)
        log.info("batch %s: flow run %s", active.id, active.flow_run_id)

    def work_on(self, active: Active) -> bool:
        run_state = self._state(active.flow_run_id) if active.flow_run_id else None
        if self.should_stop(active) and not self._stopping.is_set():
            if run_state is not None and not run_state.is_final():
                if active.id not in self._cancelled:
                    self._cancel(active.flow_run_id)
                    self._cancelled.add(active.id)
                return False
            self._stop(active)
            return True
        if run_state is None:
            return False
        if run_state.is_completed():
            self.state.db.transition(active.id, (RUNNING,), status=FINALIZING, finalizing_at=now())
            spec = job_spec(self.state, active.batch)
            self.finish(active, out.read_ledger(spec.output, spec.storage_options))
            return True
        if run_state.is_final():  # failed, crashed or cancelled from outside
            if self._runs.get(active.id, 0) < MAX_RUNS:
                log.warning(
                    "batch %s: flow run %s ended %s; starting it again (it resumes)",
                    active.id,
                    active.flow_run_id,
                    run_state.name,
                )
                self._submit(active)
                return True
            self._fail(
                active.batch,
                f"flow run {active.flow_run_id} ended {run_state.name}: {run_state.message}",
            )
            return True
        self._count(active)
        return False

    def _count(self, active: Active) -> None:
        """Rows and tokens finished so far, from the stats of the parts the run published."""
        spec = job_spec(self.state, active.batch)
        done = out.completed_shards(spec.output, spec.storage_options)
        stats = out.read_shard_stats(spec.output, sorted(done), spec.storage_options)
        self.state.db.update_batch(
            active.id,
            completed=sum(s.num_rows - s.rows_failed for s in stats),
            failed=sum(s.rows_failed for s in stats),
            input_tokens=sum(s.prompt_tokens for s in stats),
            cached_tokens=sum(s.cached_tokens for s in stats),
            output_tokens=sum(s.completion_tokens for s in stats),
            reasoning_tokens=sum(s.reasoning_tokens for s in stats),
        )

    def _stop(self, active: Active) -> None:
        """Answer what the run did not finish, then finalize, here."""
        spec = job_spec(self.state, active.batch)
        with claimed_output(spec.output, spec.storage_options):
            plan = plan_job(spec)
            stop_pending(None, plan, reason=active.stop_reason)
            ledger = finalize_job(plan, run_started_at=active.started_at)
        self.finish(active, ledger)

    @staticmethod
    def _state(flow_run_id: str) -> Any:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state

    @staticmethod
    def _cancel(flow_run_id: str) -> None:
        from prefect import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
