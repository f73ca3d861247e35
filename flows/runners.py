"""Task runners for the batch flow: where its shard tasks run.

    make_task_runner()                      threads in the flow's own process (default)
    make_task_runner(dask_workers=N)        a local Dask cluster of N worker processes
    make_task_runner(dask_address=ADDR)     an existing Dask scheduler (`tcp://host:8786`)
    make_task_runner(ray_address=ADDR)      a Ray cluster (`ray://host:10001`, or "auto")

Each worker process loads the engine once, on its first shard, and keeps it (see
`pipelines/shared_llm.py`). A worker runs one shard at a time (`threads_per_worker=1`): a shard
is already a full batch for the engine, and two on one device would only compete.

Fan-out never slows a job down: the flow cuts at least as many shards as the cluster has
workers (`num_workers`; planning's `min_shards`), says so when a job is too small to use
them all, and each worker's engine computes on the cores its worker owns
(`worker_threads`: the machine's cores shared among the Dask workers on it - Dask's
nanny would otherwise start every worker with one thread).

One worker per GPU
------------------
Give every worker process exactly one GPU and `device=None` (the default), so each
engine takes "cuda" - that worker's only visible GPU:

- with dask-cuda: `dask cuda worker tcp://SCHEDULER:8786 --nthreads 1` on each GPU
  machine (one worker per GPU, each with its own CUDA_VISIBLE_DEVICES), or in Python
  `LocalCUDACluster(threads_per_worker=1)`, then `dask_address=cluster.scheduler_address`
  (or `DaskTaskRunner(cluster_class="dask_cuda.LocalCUDACluster",
  cluster_kwargs={"threads_per_worker": 1})` with `batch_inference.with_options`);
- without dask-cuda: start one `dask worker tcp://SCHEDULER:8786 --nworkers 1
  --nthreads 1` per GPU, each under its own `CUDA_VISIBLE_DEVICES=i`;
- with Ray: Ray hides GPUs from tasks that reserve none, so run the flow inside
  `prefect_ray.context.remote_options(num_gpus=1)` (docs/flows.md, "One worker per GPU").
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

log = logging.getLogger(__name__)


def local_cluster_kwargs(num_workers: int) -> dict[str, Any]:
    """`LocalCluster` options: N single-threaded worker processes, no dashboard."""
    if num_workers < 1:
        raise ValueError(f"dask_workers must be >= 1, got {num_workers}")
    return {
        "n_workers": num_workers,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
    }


def make_task_runner(
    *,
    dask_workers: int | None = None,
    dask_address: str | None = None,
    ray_address: str | None = None,
) -> TaskRunner:
    """The task runner for one of the ways to run the flow (at most one option given).

    Args:
        dask_workers: start a local Dask cluster with this many worker processes.
        dask_address: connect to the Dask scheduler at this address.
        ray_address: connect to the Ray cluster at this address (needs prefect-ray).

    Returns:
        A Prefect TaskRunner for `batch_inference.with_options(task_runner=...)`.
    """
    given = [
        name
        for name, value in (
            ("dask_workers", dask_workers),
            ("dask_address", dask_address),
            ("ray_address", ray_address),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give at most one of dask_workers, dask_address, ray_address: {given}")
    if dask_workers is not None:
        return _dask_runner(cluster_kwargs=local_cluster_kwargs(dask_workers))
    if dask_address is not None:
        return _dask_runner(address=dask_address)
    if ray_address is not None:
        return _ray_runner(ray_address)
    # Shards then share the flow process's one engine; a second thread lets one shard's
    # writes overlap the next shard's generation (the engine lock keeps them apart).
    return ThreadPoolTaskRunner(max_workers=2)


def _dask_runner(**kwargs: Any) -> TaskRunner:
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as exc:
        raise RuntimeError(
            "the Dask task runner needs prefect-dask: pip install 'tokenmill[dask]'"
        ) from exc
    return DaskTaskRunner(**kwargs)


def _ray_runner(address: str) -> TaskRunner:
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as exc:
        raise RuntimeError(
            "the Ray task runner needs prefect-ray: pip install 'tokenmill[ray]'"
        ) from exc
    return RayTaskRunner(address=address)


def num_workers(task_runner: Any) -> int:
    """How many shards the task runner computes at once: its Dask cluster's workers, or
    1 (the default runner's threads share the flow process's one engine)."""
    client = getattr(task_runner, "_client", None)
    if client is not None:
        try:
            return max(1, len(client.scheduler_info(n_workers=-1)["workers"]))
        except Exception as exc:  # a plan for one worker still runs, only slower
            log.warning("could not count the Dask cluster's workers: %s", exc)
    cluster_kwargs = getattr(task_runner, "cluster_kwargs", None) or {}
    return max(1, int(cluster_kwargs.get("n_workers") or 1))


def worker_threads() -> int | None:
    """The threads this Dask worker's engine should compute with: the machine's cores
    shared among the Dask workers on it (None outside a Dask worker)."""
    try:
        from distributed import get_client, get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return None
    try:
        workers = get_client().scheduler_info(n_workers=-1)["workers"].values()
        on_host = sum(1 for w in workers if w.get("host") == worker.ip)
    except Exception:  # scheduler unreachable for a moment: assume it is alone
        on_host = 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, on_host))


def replicate_to_workers(task_runner: Any, future: Any) -> None:
    """Copy a task's result to every worker of the task runner's Dask cluster.

    Dask runs a task where its inputs are: the tasks that all take the job plan would
    queue on the one worker that planned, and only work stealing (which weighs the
    plan's transfer against a shard's unknown duration) would move them. With the plan
    on every worker, each shard goes to the least busy one. Best effort: a plan left on
    one worker still runs every shard, only less spread.
    """
    client = getattr(task_runner, "_client", None)
    wrapped = getattr(future, "wrapped_future", None)
    if client is None or wrapped is None:
        return
    try:
        client.replicate([wrapped])
    except Exception as exc:
        log.warning("could not copy the job plan to every Dask worker: %s", exc)
