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
