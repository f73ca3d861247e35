"""Where shard tasks run on Dask: every compute shard needs one `engine` resource, each
engine worker offers one, so N workers run N shards at once; a cluster without the
resource is refused before any compute."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster, get_worker
from flow_helpers import job_parameters

from tokenmill.flows import batch_inference, make_task_runner
from tokenmill.flows.runners import (
    ENGINE_RESOURCE,
    engine_slots,
    engine_workers,
    local_cluster_kwargs,
    num_workers,
)


def test_engine_workers_counts_the_workers_with_the_resource():
    workers = {
        "tcp://a:1": {"resources": {"engine": 1}},
        "tcp://b:1": {"resources": {"engine": 1, "gpu": 1}},
        "tcp://c:1": {"resources": {}},
        "tcp://d:1": {},
    }
    assert engine_workers(workers) == 2


@pytest.mark.parametrize("workers", [{}, {"tcp://a:1": {"resources": {}}}])
def test_a_cluster_without_engine_workers_is_refused_by_name(workers):
    with pytest.raises(RuntimeError, match=r"none offers the 'engine' resource") as info:
        engine_workers(workers)
    assert "--resources engine=1" in str(info.value)


def test_two_engine_workers_run_two_shards_at_once_and_never_two_on_one():
    def shard(seconds: float) -> tuple[str, float, float]:
        start = time.monotonic()
        time.sleep(seconds)
        return get_worker().address, start, time.monotonic()

    with LocalCluster(**local_cluster_kwargs(2)) as cluster, Client(cluster) as client:
        with make_task_runner(dask_address=cluster.scheduler_address) as runner:
            assert num_workers(runner) == 2  # counted before the runner's first task
        with engine_slots():
            futures = [client.submit(shard, 0.5, pure=False) for _ in range(4)]
        spans = client.gather(futures)
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for address, start, end in spans:
        by_worker.setdefault(address, []).append((start, end))
    assert len(by_worker) == 2  # both engines computed, two shards each
    assert sorted(len(v) for v in by_worker.values()) == [2, 2]
    for intervals in by_worker.values():  # one shard at a time per engine
        (s1, e1), (s2, e2) = sorted(intervals)
        assert s2 >= e1
    # the first two shards ran at the same time, one on each worker
    firsts = [min(v) for v in by_worker.values()]
    assert max(s for s, _ in firsts) < min(e for _, e in firsts)


def test_a_started_runner_on_a_cluster_without_engine_workers_is_refused():
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        make_task_runner(dask_address=cluster.scheduler_address) as runner,
        pytest.raises(RuntimeError, match="1 worker\\(s\\) and none offers the 'engine'"),
    ):
        num_workers(runner)


@pytest.mark.integration
def test_a_flow_on_a_cluster_without_engine_workers_fails_before_planning(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster:
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.scheduler_address)
        )
        state = flow(
            **job_parameters(jsonl_input, str(tmp_path / "out"), tiny_model), return_state=True
        )
    assert state.is_failed()
    with pytest.raises(RuntimeError, match=f"none offers the '{ENGINE_RESOURCE}' resource"):
        state.result()
    assert not (tmp_path / "out").exists()  # refused before the output was touched
