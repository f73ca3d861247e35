"""A Dask worker process killed mid-shard, in a batch flow on a real local Dask cluster.

The kill comes from a Dask worker plugin (a fault hook inside the worker): when the
`kill_at`-th shard task starts executing anywhere in the cluster, a thread in the
worker running it waits until the shard holds the engine's lock - it is then inside
`run_shard`, generating or writing its part - and SIGKILLs the worker at once. A
marker file (created with O_EXCL) makes exactly one worker do it and records its pid
and the shard. The nanny starts a fresh worker; the scheduler runs the lost shard
(and any result the dead worker held) again elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from distributed.diagnostics.plugin import WorkerPlugin
from operator_cluster import START_TIMEOUT_S
from store_fixtures import lost_and_duplicated

SHARD_TASK_PREFIX = "shard_task"


class KillWorkerMidShard(WorkerPlugin):
    """Kills the worker that starts the `kill_at`-th shard task, `delay_s` into it."""

    name = "kill-worker-mid-shard"

    def __init__(self, marker: str, kill_at: int = 2):
        self.marker = marker
        self.kill_at = kill_at

    def setup(self, worker) -> None:
        self.worker = worker

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        if finish != "executing" or SHARD_TASK_PREFIX not in str(key):
            return
        count_file = Path(self.marker + ".started")
        # Shard starts are counted across processes by appending one byte each.
        with open(count_file, "ab") as f:
            f.write(b".")
        if count_file.stat().st_size < self.kill_at:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another worker already died for this run
        os.write(fd, json.dumps({"pid": os.getpid(), "key": str(key)}).encode())
        os.close(fd)
        threading.Thread(target=_kill_inside_shard, daemon=True).start()


def _kill_inside_shard(timeout_s: float = 60.0) -> None:
    """SIGKILL this process as soon as a shard holds the engine lock (is in run_shard)."""
    from tokenmill.pipelines import shared_llm as llm_cache

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shared = llm_cache._current
        if shared is not None and shared.lock.locked():
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)


@dataclass
class WorkerDeathRun:
    rows_lost: int
    rows_duplicated: int
    killed_pid: int | None
    killed_key: str | None
    completed: bool
    message: str | None
    num_shards: int
    ledger_rows: int
    num_parts: int  # result part files in the output
    num_temp_files: int  # temporary files left anywhere under the output


def run_with_worker_death(
    input_path: str,
    output: str,
    model: str,
    marker: str,
    *,
    num_workers: int = 2,
    kill_at: int = 2,
    scheduler_address: str | None = None,
    **options,
) -> WorkerDeathRun:
    """Runs `batch_inference` on a fresh LocalCluster (or the cluster at
    `scheduler_address`) whose workers carry the kill hook.

    Needs PREFECT_API_URL pointing at a real server (the workers report to it).

    Args:
        kill_at: the worker running the kill_at-th shard task to start dies in it.
    """
    from distributed import Client, LocalCluster

    from tokenmill.connectors.atomic import is_temp_name
    from tokenmill.flows import batch_inference, make_task_runner
    from tokenmill.flows.runners import local_cluster_kwargs
    from tokenmill.pipelines.output import read_results

    with contextlib.ExitStack() as stack:
        if scheduler_address is None:
            cluster = stack.enter_context(LocalCluster(**local_cluster_kwargs(num_workers)))
            scheduler_address = cluster.scheduler_address
        client = stack.enter_context(Client(scheduler_address))
        client.register_plugin(KillWorkerMidShard(marker, kill_at))
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=scheduler_address)
        )
        state = flow(input=input_path, output=output, model=model, return_state=True, **options)
    killed = json.loads(Path(marker).read_text()) if Path(marker).exists() else {}
    ids = [json.loads(line)["id"] for line in Path(input_path).read_text().splitlines()]
    results = read_results(output)["id"].to_pylist()
    lost, duplicated = lost_and_duplicated(results, ids)
    ledger = state.result() if state.is_completed() else None
    return WorkerDeathRun(
        rows_lost=lost,
        rows_duplicated=duplicated,
        killed_pid=killed.get("pid"),
        killed_key=killed.get("key"),
        completed=state.is_completed(),
        message=state.message,
        num_shards=ledger.num_shards if ledger else 0,
        ledger_rows=(ledger.rows_ok + ledger.rows_failed) if ledger else 0,
        num_parts=len(list(Path(output, "results").glob("*.parquet"))),
        num_temp_files=sum(1 for p in Path(output).rglob("*") if is_temp_name(p.name)),
    )


@dataclass
class SchedulerRestartRun:
    restarted: bool  # the scheduler was killed after `after_parts` parts and started again
    first_completed: bool
    first_message: str | None
    first_seconds: float
    rerun_completed: bool
    rows_lost: int  # after the rerun, against the input's ids
    rows_duplicated: int
    num_temp_files: int


def run_with_scheduler_restart(
    cluster,
    input_path: str,
    output: str,
    model: str,
    *,
    after_parts: int = 2,
    timeout_s: float = 300,
    **options,
) -> SchedulerRestartRun:
    """Runs `batch_inference` on an operator cluster (tests/faults/operator_cluster.py)
    whose scheduler is SIGKILLed and started again on the same address once `after_parts`
    result parts are published; then runs the same job again, as an operator would."""
    from tokenmill.connectors.atomic import is_temp_name
    from tokenmill.flows import batch_inference, make_task_runner
    from tokenmill.pipelines.output import read_results

    restarted = threading.Event()

    def restart_after_parts() -> None:
        results = Path(output, "results")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if len(list(results.glob("*.parquet"))) >= after_parts:
                cluster.restart_scheduler()
                restarted.set()
                return
            time.sleep(0.05)

    def run_flow():
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.address)
        )
        return flow(input=input_path, output=output, model=model, return_state=True, **options)

    watcher = threading.Thread(target=restart_after_parts, daemon=True)
    watcher.start()
    # The first run goes in a thread so that a flow hanging on the lost scheduler fails
    # the scenario after `timeout_s` instead of hanging the test run.
    outcome: dict = {}
    flow_thread = threading.Thread(target=lambda: outcome.update(state=run_flow()), daemon=True)
    started = time.monotonic()
    flow_thread.start()
    flow_thread.join(timeout=timeout_s)
    first_seconds = time.monotonic() - started
    if "state" not in outcome:
        raise AssertionError(f"the flow did not end {timeout_s:.0f} s after it started")
    first = outcome["state"]
    watcher.join(timeout=START_TIMEOUT_S)
    rerun = run_flow()
    ids = [json.loads(line)["id"] for line in Path(input_path).read_text().splitlines()]
    lost, duplicated = lost_and_duplicated(read_results(output)["id"].to_pylist(), ids)
    return SchedulerRestartRun(
        restarted=restarted.is_set(),
        first_completed=first.is_completed(),
        first_message=first.message,
        first_seconds=first_seconds,
        rerun_completed=rerun.is_completed(),
        rows_lost=lost,
        rows_duplicated=duplicated,
        num_temp_files=sum(1 for p in Path(output).rglob("*") if is_temp_name(p.name)),
    )


@dataclass
class StoreOutageRun:
    """What a flow on an operator cluster left after its store went down mid-job."""

    num_faults: int  # store requests the proxy reset
    first_completed: bool
    first_message: str
    rerun_completed: bool | None  # None: the first run completed, no rerun
    rows_lost: int
    rows_duplicated: int
    num_parts: int
    num_shards: int
    num_temp_files: int


def run_with_store_outage(
    cluster, endpoint, model: str, *, outage_s: float, prefix: str, **options
) -> StoreOutageRun:
    """Runs `batch_inference` on an operator cluster (tests/faults/operator_cluster.py)
    with its input and output on the loopback S3 store, every store request of every
    process going through a fault proxy; once the first part is published the store
    goes down (every request reset, as a stopped server) for `outage_s` seconds. A run
    that fails is run again once, as an operator would, after the store is back."""
    from prefect.blocks.system import Secret
    from proxy import FaultProxy
    from scenarios_b import outage
    from store_fixtures import bucket_objects, prompt_rows, through, upload_rows
    from store_scenarios import drop_own_unreleased_lock

    from tokenmill.connectors.atomic import TEMP_MARKER
    from tokenmill.flows import batch_inference, make_task_runner
    from tokenmill.pipelines.output import read_ledger, read_results

    rows = prompt_rows()
    source = upload_rows(endpoint, f"{prefix}/in/data.parquet", rows)
    output = endpoint.url(f"{prefix}/out")
    with FaultProxy(endpoint.endpoint_url, []) as proxy:
        # Storage options reach the workers as every flow's do: in a Secret block.
        secret = f"tm-outage-{prefix}"
        Secret(value=through(endpoint, proxy.url)).save(secret, overwrite=True)
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.address)
        )

        def run_flow():
            return flow(
                input=source,
                output=output,
                model=model,
                storage_secret=secret,
                return_state=True,
                **options,
            )

        outage(outage_s)(proxy)
        first = run_flow()
        num_faults = proxy.faults()
        rerun = None
        if not first.is_completed():
            time.sleep(outage_s)  # the store is back by then, whenever the run failed
            drop_own_unreleased_lock(endpoint, prefix)
            rerun = run_flow()
    ids = read_results(output, endpoint.storage_options)["id"].to_pylist()
    lost, duplicated = lost_and_duplicated(ids, [r["id"] for r in rows])
    keys = bucket_objects(endpoint, f"{prefix}/out")
    return StoreOutageRun(
        num_faults=num_faults,
        first_completed=first.is_completed(),
        first_message=first.message or "",
        rerun_completed=None if rerun is None else rerun.is_completed(),
        rows_lost=lost,
        rows_duplicated=duplicated,
        num_parts=sum(1 for k in keys if "/results/" in k and TEMP_MARKER not in k),
        num_shards=read_ledger(output, endpoint.storage_options).num_shards,
        num_temp_files=sum(1 for k in keys if TEMP_MARKER in k),
    )
