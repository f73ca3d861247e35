"""Task runners for the batch flow: where its shard tasks run.

    make_task_runner()                      threads in the flow's own process (default)
    make_task_runner(dask_workers=N)        a local Dask cluster of N worker processes
    make_task_runner(dask_address=ADDR)     an existing Dask scheduler (`tcp://host:8786`)
    make_task_runner(ray_address=ADDR)      a Ray cluster (`ray://host:10001`, or "auto")

Each worker process loads the engine once and keeps it (see `pipelines/shared_llm.py`):
the flow has every engine worker start its load while it plans (`preload_engines`), so
shards start on a loaded engine and no worker starts its first shard a load later than
another. A worker runs one shard at a time (`threads_per_worker=1`): a shard
is already a full batch for the engine, and two on one device would only compete.

Placement: Dask resources
-------------------------
Every engine worker offers one `engine` resource (`dask worker ADDR --nthreads 1
--resources engine=1`; the local cluster's workers have it), and every compute shard
task needs one (`engine_slots()` around its submission). The scheduler then never
queues two shards on one engine while another engine worker has none, a worker
joining late takes shards as soon as it is up, and a lost worker's shards go to any
other engine worker (a task pinned to a worker's address would be stranded with it).
A cluster without any `engine` worker is refused before planning (`num_workers`).
Nothing records addresses: a rerun resumes from the shard cut in the output.

Fan-out never slows a job down: the flow cuts at least as many shards as the cluster has
workers (`num_workers`; planning's `min_shards`), says so when a job is too small to use
them all, and each worker's engine computes on the cores its worker owns
(`worker_threads`: the machine's cores shared among the Dask workers on it - Dask's
nanny would otherwise start every worker with one thread).

Planning on the workers
-----------------------
On a Dask cluster the flow's plan task spreads reading, templating, tokenizing and the
id checks over the workers (`planning_fan_out`, `pipelines/spread_planning.py`): one
part per engine worker, each reading its own partitions of the input, submitted from
the plan task through `worker_client`, which hands the plan task's thread back to its
worker while the parts run (a one-thread worker would otherwise wait on itself). The parts need no `engine` resource.

Memory: the nanny's limit from the engine's budget
--------------------------------------------------
A local cluster started for a job (`dask_workers` with the job's `engine_memory`, its
`MemoryPlan`) gives each worker's nanny a memory limit of the engine's weights and KV
cache plus `ENGINE_HEADROOM_BYTES`, and refuses to start workers whose engines would
not fit in the RAM the machine has left together. A worker past its limit is
restarted by its nanny and its shard runs again elsewhere, instead of the kernel
killing a process at random. Dask's spill and pause thresholds are off on such
workers: they are for Dask's own data, and an engine's memory is not; paused at 80%
of a limit its engine fills by design, a worker would never take another shard. On
`dask worker` processes an operator gives the same `--memory-limit` (docs/dask.md).

One worker per GPU
------------------
Give every worker process exactly one GPU and `device=None` (the default), so each
engine takes "cuda" - that worker's only visible GPU:

- with dask-cuda: `dask cuda worker tcp://SCHEDULER:8786 --nthreads 1 --resources
  engine=1` on each GPU machine (one worker per GPU, each with its own
  CUDA_VISIBLE_DEVICES), or in Python `LocalCUDACluster(threads_per_worker=1,
  resources={"engine": 1})`, then `dask_address=cluster.scheduler_address` (or
  `DaskTaskRunner(cluster_class="dask_cuda.LocalCUDACluster", cluster_kwargs=
  {"threads_per_worker": 1, "resources": {"engine": 1}})` with
  `batch_inference.with_options`);
- without dask-cuda: start one `dask worker tcp://SCHEDULER:8786 --nworkers 1
  --nthreads 1 --resources engine=1` per GPU, each under its own `CUDA_VISIBLE_DEVICES=i`;
- with Ray: Ray hides GPUs from tasks that reserve none, so run the flow inside
  `prefect_ray.context.remote_options(num_gpus=1)` (docs/flows.md, "One worker per GPU").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from tokenmill.engine import MemoryPlan

log = logging.getLogger(__name__)

# The Dask resource a worker offers per engine it can hold, and a compute shard needs.
ENGINE_RESOURCE = "engine"
# How long a flow waits for the first worker of a cluster that has none yet.
WORKERS_JOIN_S = 30
# An engine worker's memory beyond its weights and KV cache: the Python and torch
# runtime, a step's activations, the shard's rows and the part being written.
ENGINE_HEADROOM_BYTES = 2 << 30
# Dask's memory thresholds act on Dask's own data; an engine's memory is not.
ENGINE_WORKER_CONFIG = {
    "distributed": {"worker": {"memory": {"target": False, "spill": False, "pause": False}}}
}


def worker_memory_limit(memory: MemoryPlan) -> int:
    """The nanny's memory limit for a worker holding one engine of this memory plan."""
    return memory.weight_bytes + memory.kv_cache_bytes + ENGINE_HEADROOM_BYTES


def local_cluster_kwargs(
    num_workers: int, engine_memory: MemoryPlan | None = None
) -> dict[str, Any]:
    """`LocalCluster` options: N single-threaded worker processes, each offering one
    engine, no dashboard; with the engine's memory plan (a CPU engine's), each nanny's
    memory limit sized from it ("Memory" above).

    Raises:
        RuntimeError: the N engines do not fit in the RAM the plan found available.
    """
    if num_workers < 1:
        raise ValueError(f"dask_workers must be >= 1, got {num_workers}")
    kwargs: dict[str, Any] = {
        "n_workers": num_workers,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
        "resources": {ENGINE_RESOURCE: 1},
    }
    if engine_memory is None:
        return kwargs
    limit = worker_memory_limit(engine_memory)
    available = engine_memory.available_bytes
    if available is not None and num_workers * limit > available:
        raise RuntimeError(
            f"{num_workers} Dask workers of one engine each need {num_workers} x "
            f"{limit / 2**30:.1f} GiB (weights {engine_memory.weight_bytes / 2**30:.1f}, KV "
            f"cache {engine_memory.kv_cache_bytes / 2**30:.1f}, headroom "
            f"{ENGINE_HEADROOM_BYTES / 2**30:.1f}), but this machine has "
            f"{available / 2**30:.1f} GiB available: use fewer workers or a smaller "
            "--engine-option kv_cache_memory=BYTES"
        )
    return {**kwargs, "memory_limit": limit, "config": _worker_config()}


def _worker_config() -> dict[str, Any]:
    """This process's Dask config with `ENGINE_WORKER_CONFIG` over it: a worker process
    takes a nanny's config as its whole config, not as changes to its defaults."""
    import dask

    return dask.config.merge(dask.config.config, ENGINE_WORKER_CONFIG)


def engine_slots() -> contextlib.AbstractContextManager:
    """Dask tasks submitted inside need one `engine` resource each (no effect on the
    other task runners)."""
    try:
        import dask
    except ImportError:
        return contextlib.nullcontext()
    return dask.annotate(resources={ENGINE_RESOURCE: 1})


def engine_workers(workers: Mapping[str, Mapping[str, Any]]) -> int:
    """How many of a Dask scheduler's workers (`scheduler_info()["workers"]`) offer an
    engine; refuses a cluster where none does, since its shard tasks would never start."""
    engines = sum(1 for w in workers.values() if _offers_engine(w))
    if engines == 0:
        raise RuntimeError(
            f"the Dask cluster has {len(workers)} worker(s) and none offers the "
            f"{ENGINE_RESOURCE!r} resource that shard tasks need: start each worker with "
            f"`dask worker SCHEDULER_ADDRESS --nthreads 1 --resources {ENGINE_RESOURCE}=1`"
        )
    return engines


def _offers_engine(worker: Mapping[str, Any]) -> bool:
    """Whether a worker (an entry of `scheduler_info()["workers"]`) offers an engine slot."""
    return (worker.get("resources") or {}).get(ENGINE_RESOURCE, 0) >= 1


def make_task_runner(
    *,
    dask_workers: int | None = None,
    dask_address: str | None = None,
    ray_address: str | None = None,
    engine_memory: MemoryPlan | None = None,
) -> TaskRunner:
    """The task runner for one of the ways to run the flow (at most one option given).

    Args:
        dask_workers: start a local Dask cluster with this many worker processes.
        engine_memory: with dask_workers, the job's engine memory plan (`LLM.plan`'s
            `shape.memory`): each worker's memory limit is sized from it.
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
        return _dask_runner(cluster_kwargs=local_cluster_kwargs(dask_workers, engine_memory))
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
    """How many shards the task runner computes at once: its Dask cluster's engine
    workers (refusing a cluster without any, `engine_workers`), or 1 (the default
    runner's threads share the flow process's one engine)."""
    client = _started_dask_client(task_runner)
    if client is not None:
        try:
            workers = _joined_workers(client)
        except Exception as exc:  # a plan for one worker still runs, only slower
            log.warning("could not count the Dask cluster's workers: %s", exc)
        else:
            return engine_workers(workers)
    cluster_kwargs = getattr(task_runner, "cluster_kwargs", None) or {}
    return max(1, int(cluster_kwargs.get("n_workers") or 1))


def _joined_workers(client: Any) -> dict[str, Any]:
    """The scheduler's workers, waiting a little for the first one of a cluster that
    has just started (none after that wait: the cluster is refused, not waited on)."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    if not workers:
        try:
            client.wait_for_workers(1, timeout=WORKERS_JOIN_S)
        except TimeoutError:
            return {}
        workers = client.scheduler_info(n_workers=-1)["workers"]
    return workers


def _started_dask_client(task_runner: Any) -> Any:
    """A started Dask task runner's client (None for any other runner). Prefect's runner
    connects on first use, and the flow asks before its first task: connecting here is
    what lets a flow on `dask_address` count that cluster's workers."""
    if not getattr(task_runner, "_started", False):
        return None
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        return None
    if not isinstance(task_runner, DaskTaskRunner):
        return None
    return task_runner.client


def worker_threads(worker: Any = None) -> int | None:
    """The threads this Dask worker's engine should compute with: the machine's cores
    shared among the Dask workers on it (None outside a Dask worker). `worker`: the
    Dask worker, where `get_worker()` does not know it (outside its tasks' threads)."""
    try:
        from distributed import get_worker

        worker = worker or get_worker()
    except (ImportError, ValueError):
        return None
    try:
        workers = worker.client.scheduler_info(n_workers=-1)["workers"].values()
        on_host = sum(1 for w in workers if w.get("host") == worker.ip)
    except Exception:  # scheduler unreachable for a moment: assume it is alone
        on_host = 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, on_host))


def preload_engines(task_runner: Any, llm_options: dict[str, Any]) -> None:
    """Have every engine worker of the task runner's Dask cluster start loading the
    job's engine now, in a thread of its own (`shared_llm.preload`), so the load runs
    while the flow plans instead of in each worker's first shard. A worker whose engine
    is warm does nothing; one that joins later loads on its first shard. Best effort:
    a worker that misses the request, or whose load fails, loads when its first shard
    asks (and fails there, naming the error)."""
    client = _started_dask_client(task_runner)
    if client is None:
        return
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        engines = [address for address, w in workers.items() if _offers_engine(w)]
        if engines:
            # Outside the task system: it runs at once, beside whatever task the worker
            # runs (the plan task), and returns once the loading thread has started.
            client.run(_start_preload, llm_options, workers=engines)
    except Exception as exc:
        log.warning("could not ask the Dask workers to load the engine ahead: %s", exc)


def _start_preload(llm_options: dict[str, Any], dask_worker: Any = None) -> None:
    """On a worker (`Client.run` passes `dask_worker`, and runs this on the worker's
    event loop): start a thread that loads its engine, computing on the worker's cores."""
    import torch

    from tokenmill.pipelines import shared_llm

    def load() -> None:
        threads = worker_threads(dask_worker)
        if threads is not None:
            torch.set_num_threads(threads)
        shared_llm.preload(**llm_options)

    threading.Thread(target=load, name="tokenmill-preload", daemon=True).start()


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


@dataclass(frozen=True)
class DaskFanOut:
    """Runs planning's parts as Dask tasks (`pipelines/spread_planning.FanOut`), from a
    task on a worker or from a process holding a Dask client."""

    num_parts: int

    def map(self, fn: Callable, args: Sequence[tuple]) -> list:
        from distributed import get_client, get_worker, worker_client

        try:
            get_worker()
        except ValueError:  # not on a worker: the process's own client
            return _gather(get_client(), fn, args)
        with worker_client() as client:
            return _gather(client, fn, args)

    def imap(self, fn: Callable, args: Sequence[tuple]) -> Iterator:
        from distributed import get_client, get_worker, worker_client

        try:
            get_worker()
        except ValueError:  # not on a worker: the process's own client
            yield from _in_order(get_client(), fn, args)
            return
        # The plan task's thread is handed back to its worker while it cuts what the
        # parts staged, so that worker runs parts meanwhile.
        with worker_client() as client:
            yield from _in_order(client, fn, args)


def _in_order(client: Any, fn: Callable, args: Sequence[tuple]) -> Iterator:
    """The answers in the order of `args`, each as soon as it and those before it are
    done; the first error raised as soon as any task fails, the others then cancelled.
    Tasks run in submission order where workers are busy (Dask's FIFO)."""
    from distributed import as_completed

    futures = _submit(client, fn, args)
    done: dict[int, Any] = {}
    index = {f.key: i for i, f in enumerate(futures)}
    try:
        following = 0
        for future in as_completed(futures):
            if future.status == "error":
                future.result()  # raises the task's error, as raised
            done[index[future.key]] = future
            while following in done:
                answer = done.pop(following).result()
                futures[following] = None  # not held once answered
                following += 1
                yield answer
    finally:
        client.cancel([f for f in futures if f is not None and not f.done()])


def _submit(client: Any, fn: Callable, args: Sequence[tuple]) -> list:
    """A task per entry of `args`, each named after `fn` (as Dask names `fn`'s own)."""
    return [
        client.submit(_in_core_share, fn, *a, key=f"{fn.__name__}-{uuid.uuid4().hex}") for a in args
    ]


def _in_core_share(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` on a worker, the tokenizer's threads held to the worker's share of
    the machine's cores. Its thread pool would take every core, so two workers
    tokenizing on one machine would each run a thread per core, contending for them
    (as the engine's threads are held to the share, `worker_threads`). The pool is made
    at the process's first parallel tokenizing and keeps its size, so this holds where
    planning is the first to tokenize on the worker (an engine worker's own prompts
    come tokenized from the plan)."""
    threads = worker_threads()
    if threads is not None:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    return fn(*args)


def _gather(client: Any, fn: Callable, args: Sequence[tuple]) -> list:
    futures = _submit(client, fn, args)
    try:
        return client.gather(futures)
    except BaseException:
        client.cancel(futures)  # the first error decides; the other parts stop
        raise


def planning_fan_out(task_runner: Any, workers: int) -> DaskFanOut | None:
    """How the flow's plan task spreads its reading: over `workers` parts on a Dask
    cluster, else not at all (None: the plan task reads the input itself)."""
    if _started_dask_client(task_runner) is None:
        return None
    return DaskFanOut(workers)
