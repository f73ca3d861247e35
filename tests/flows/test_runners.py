"""Choosing where shard tasks run."""

from __future__ import annotations

import importlib.util

import pytest
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from tokenmill.flows.runners import local_cluster_kwargs, make_task_runner


def test_default_is_threads_in_the_flow_process():
    assert isinstance(make_task_runner(), ThreadPoolTaskRunner)


def test_local_dask_cluster_has_single_threaded_worker_processes():
    runner = make_task_runner(dask_workers=3)
    assert isinstance(runner, DaskTaskRunner)
    assert runner.cluster_kwargs == {
        "n_workers": 3,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
    }


def test_existing_dask_scheduler():
    runner = make_task_runner(dask_address="tcp://10.0.0.5:8786")
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://10.0.0.5:8786"


def test_one_cluster_at_most():
    with pytest.raises(ValueError, match="at most one"):
        make_task_runner(dask_workers=2, ray_address="auto")
    with pytest.raises(ValueError, match=">= 1"):
        local_cluster_kwargs(0)


@pytest.mark.skipif(importlib.util.find_spec("prefect_ray") is not None, reason="installed")
def test_ray_without_prefect_ray_says_what_to_install():
    with pytest.raises(RuntimeError, match="prefect-ray"):
        make_task_runner(ray_address="auto")


@pytest.mark.skipif(importlib.util.find_spec("prefect_ray") is None, reason="needs prefect-ray")
def test_ray_runner_when_installed():
    from prefect_ray import RayTaskRunner

    runner = make_task_runner(ray_address="ray://head:10001")
    assert isinstance(runner, RayTaskRunner) and runner.address == "ray://head:10001"
