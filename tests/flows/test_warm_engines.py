"""Warm engines: one per worker process, kept across shards and across flow runs on a
long-lived cluster; a change of model or settings frees the old one; the flow reports
each worker's engine loads."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from distributed import Client, LocalCluster
from flow_helpers import ENGINE, job_parameters
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)

from tokenmill.flows import batch_inference, make_task_runner
from tokenmill.flows.batch_flow import worker_rows
from tokenmill.flows.runners import local_cluster_kwargs
from tokenmill.flows.tasks import ShardRun
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.running import ShardResult


def test_the_first_call_loads_later_ones_reuse_and_a_change_frees_the_old(tiny_model):
    llm_cache.clear()
    options = {"dtype": "float32", "kv_cache_memory": ENGINE["engine_options"]["kv_cache_memory"]}
    first, loaded = llm_cache.acquire_llm(tiny_model, **options)
    assert loaded and first.load_seconds > 0
    again, loaded_again = llm_cache.acquire_llm(tiny_model, **options)
    assert again is first and not loaded_again
    old = weakref.ref(first.llm)
    del first, again
    other, loaded_other = llm_cache.acquire_llm(
        tiny_model, **{**options, "kv_cache_memory": 8 << 20}
    )
    assert loaded_other
    gc.collect()
    assert old() is None  # the previous engine is gone, not kept beside the new one
    del other
    llm_cache.clear()


def _run(worker: str, load_s: float | None, skipped: bool = False) -> ShardRun:
    host, pid = worker.split(":")
    return ShardRun(ShardResult("s", skipped, num_rows=3), host, int(pid), 1, load_s)


def test_worker_rows_count_shards_and_loads_per_worker():
    runs = [_run("h:1", 2.5), _run("h:1", None), _run("h:2", 1.25), _run("h:2", None, True)]
    assert worker_rows(runs) == [
        {"worker": "h:1", "shards": 2, "engine loads": 1, "load s": 2.5},
        {"worker": "h:2", "shards": 1, "engine loads": 1, "load s": 1.25},
    ]


def _workers_artifact(flow_run_id) -> list[dict]:
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    tables = [a for a in artifacts if (a.key or "").startswith("tokenmill-workers-")]
    assert len(tables) == 1, [a.key for a in artifacts]
    data = tables[0].data
    return json.loads(data) if isinstance(data, str) else data


def _plan_task_end(flow_run_id) -> float:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    plans = [r for r in runs if r.name.startswith("plan ")]
    assert len(plans) == 1 and plans[0].end_time is not None, [r.name for r in runs]
    return plans[0].end_time.timestamp()


def _load_started_at() -> float:
    return llm_cache._current.load_started_at


@pytest.mark.integration
def test_a_second_flow_run_on_the_same_cluster_loads_no_engine(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    with LocalCluster(**local_cluster_kwargs(2)) as cluster, Client(cluster) as client:
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.scheduler_address)
        )
        states = []
        for name in ("first", "second"):
            params = job_parameters(jsonl_input, str(tmp_path / name), tiny_model)
            states.append(flow(**params, return_state=True))
            assert states[-1].is_completed(), states[-1].message
            loads = client.run(llm_cache.num_loads)
            assert sorted(loads.values()) == [1, 1], loads  # one load per worker, ever
            if name == "first":
                # Each worker began loading while the flow planned, not in its first shard.
                plan_end = _plan_task_end(states[-1].state_details.flow_run_id)
                started = client.run(_load_started_at)
                assert all(at < plan_end for at in started.values()), (started, plan_end)
    first, second = (_workers_artifact(s.state_details.flow_run_id) for s in states)
    assert len(first) == 2 and all(row["engine loads"] == 1 for row in first), first
    assert all(row["load s"] > 0 for row in first), first
    assert len(second) == 2 and all(row["engine loads"] == 0 for row in second), second
    assert sum(row["shards"] for row in second) == states[1].result().num_shards


@pytest.mark.integration
def test_a_rerun_of_a_finished_job_loads_no_engine(prefect_api, jsonl_input, tmp_path, tiny_model):
    params = job_parameters(jsonl_input, str(tmp_path / "out"), tiny_model)
    for expected_loads in ([1, 1], [0, 0]):  # a fresh cluster each time
        with LocalCluster(**local_cluster_kwargs(2)) as cluster, Client(cluster) as client:
            flow = batch_inference.with_options(
                task_runner=make_task_runner(dask_address=cluster.scheduler_address)
            )
            state = flow(**params, return_state=True)
            assert state.is_completed(), state.message
            # The rerun finds every shard done: no worker loads an engine ahead for it.
            loads = client.run(llm_cache.num_loads)
            assert sorted(loads.values()) == expected_loads, loads
