"""Choosing where shard tasks run."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from tokenmill.engine import MemoryPlan
from tokenmill.flows.runners import (
    DaskFanOut,
    local_cluster_kwargs,
    make_task_runner,
    planning_fan_out,
)


def test_default_is_threads_in_the_flow_process():
    assert isinstance(make_task_runner(), ThreadPoolTaskRunner)


def test_planning_is_spread_over_a_dask_clusters_workers_only():
    from distributed import LocalCluster

    with ThreadPoolTaskRunner() as runner:
        assert planning_fan_out(runner, 2) is None  # the plan task reads the input itself
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        make_task_runner(dask_address=cluster.scheduler_address) as runner,
    ):
        assert planning_fan_out(runner, 3) == DaskFanOut(3)


def test_local_dask_cluster_has_single_threaded_worker_processes():
    runner = make_task_runner(dask_workers=3)
    assert isinstance(runner, DaskTaskRunner)
    assert runner.cluster_kwargs == {
        "n_workers": 3,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
        "resources": {"engine": 1},
    }


def test_existing_dask_scheduler():
    runner = make_task_runner(dask_address="tcp://10.0.0.5:8786")
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://10.0.0.5:8786"


def test_one_cluster_at_most():
    with pytest.raises(ValueError, match="at most one"):
        make_task_runner(dask_workers=2, ray_address="auto")
    with pytest.raises(ValueError, match=">= 1"):
        local_cluster_kwargs(0)


def test_ray_runner_or_what_to_install():
    # prefect-ray is optional (the `ray` extra): with it a Ray address gives a
    # RayTaskRunner, without it the error names the package to install.
    if importlib.util.find_spec("prefect_ray") is None:
        with pytest.raises(RuntimeError, match="prefect-ray"):
            make_task_runner(ray_address="auto")
        return
    from prefect_ray import RayTaskRunner

    runner = make_task_runner(ray_address="ray://head:10001")
    assert isinstance(runner, RayTaskRunner) and runner.address == "ray://head:10001"


def _memory(weights_gib: float, kv_gib: float, available_gib: float | None) -> MemoryPlan:
    gib = 1 << 30
    available = None if available_gib is None else int(available_gib * gib)
    return MemoryPlan("cpu", "bfloat16", int(weights_gib * gib), int(kv_gib * gib), 64, available)


def test_a_local_clusters_workers_get_the_engines_memory_as_their_limit():
    kwargs = local_cluster_kwargs(2, _memory(1.5, 4, 64))
    assert kwargs["memory_limit"] == int(7.5 * (1 << 30))  # 1.5 + 4 + 2 GiB of headroom
    memory = kwargs["config"]["distributed"]["worker"]["memory"]
    assert (memory["target"], memory["spill"], memory["pause"]) == (False, False, False)
    assert memory["terminate"] == 0.95  # the nanny still restarts a worker past its limit
    runner = make_task_runner(dask_workers=2, engine_memory=_memory(1.5, 4, 64))
    assert runner.cluster_kwargs == kwargs
    # a GPU engine's plan (none) or no plan: Dask's own default limit
    assert "memory_limit" not in local_cluster_kwargs(2)


def test_engines_that_do_not_fit_together_are_refused():
    with pytest.raises(RuntimeError, match=r"^3 Dask workers .* 3 x 7.5 GiB .* 20.0 GiB available"):
        local_cluster_kwargs(3, _memory(1.5, 4, 20))
    assert local_cluster_kwargs(2, _memory(1.5, 4, 20))["memory_limit"] > 0


def test_the_limit_and_thresholds_reach_the_workers():
    import dask
    from distributed import Client, LocalCluster

    limit = int(3.5 * (1 << 30))
    with (
        LocalCluster(**local_cluster_kwargs(1, _memory(0.5, 1, None))) as cluster,
        Client(cluster) as client,
    ):
        (worker,) = client.scheduler_info(n_workers=-1)["workers"].values()
        assert worker["memory_limit"] == limit
        seen = client.run(lambda: dask.config.get("distributed.worker.memory.pause"))
        assert list(seen.values()) == [False]


def test_the_cli_sizes_a_local_clusters_workers_from_the_jobs_engine(tmp_path, tiny_model):
    from tokenmill.cli.flow import engine_memory
    from tokenmill.engine import LLM

    job = {"input": "in.jsonl", "output": str(tmp_path), "model": tiny_model}
    memory = engine_memory({**job, "engine_options": {"kv_cache_memory": 64 << 20}})
    planned = LLM.plan([], model=tiny_model, kv_cache_memory=64 << 20).shape.memory
    # RAM still available is read at each plan and moves between the two: the rest must match.
    assert replace(memory, available_bytes=None) == replace(planned, available_bytes=None)
    assert memory.kv_cache_bytes <= 64 << 20 and memory.weight_bytes > 0


def _tokenizer_threads(_: int) -> str | None:
    import os

    return os.environ.get("RAYON_NUM_THREADS")


def test_planning_parts_tokenize_on_their_workers_share_of_the_cores(monkeypatch):
    # Two workers on this machine: each part's tokenizer pool is held to half its cores
    # (the pool would otherwise run a thread per core in each worker).
    import os

    from distributed import Client, LocalCluster

    monkeypatch.setenv("RAYON_NUM_THREADS", "")  # so that it is unset again after
    monkeypatch.delenv("RAYON_NUM_THREADS")
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster),
    ):
        answers = DaskFanOut(2).map(_tokenizer_threads, [(0,), (1,)])
        in_order = list(DaskFanOut(2).imap(_tokenizer_threads, [(0,), (1,)]))
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert answers == in_order == [share, share]
