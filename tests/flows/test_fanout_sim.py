"""The flow on many Dask workers with sleeping engines (`tokenmill/bench/fanout_sim.py`):
N workers all compute at once, one shard each, every shard exactly once; and the costs
the scale model takes are read from the recorded moments as defined."""

from __future__ import annotations

import pytest

from tokenmill.bench.fanout_model import FanoutCosts
from tokenmill.bench.fanout_sim import ShardTimes, costs_from, predict, run_sleep_fanout
from tokenmill.pipelines import output as out


def test_costs_are_read_from_each_workers_shards():
    # Two workers; w1 runs two shards, w2 one. Each shard: 1 s before its compute,
    # 2 s computing, 0.5 s to commit; w1's second shard starts 0.25 s after its first
    # committed.
    shards = [
        ShardTimes("w1", task_start=10.0, compute_start=11.0, compute_end=13.0, commit_end=13.5),
        ShardTimes("w2", task_start=10.5, compute_start=11.5, compute_end=13.5, commit_end=14.0),
        ShardTimes(
            "w1", task_start=13.75, compute_start=14.75, compute_end=16.75, commit_end=17.25
        ),
    ]
    costs = costs_from(shards, flow_start=4.0, flow_end=20.0)
    assert costs.hand_out_s == 0.5  # the two first-wave starts, 10.0 and 10.5
    assert costs.worker_s == 1.5 and costs.commit_s == 0.5
    assert costs.gap_s == 0.25
    assert (costs.planning_s, costs.finalize_s) == (6.0, 2.75)
    assert costs.model() == FanoutCosts(0.5, 0.0, 1.5, 6.0, 2.75)


def test_a_shard_that_never_committed_is_refused():
    shards = [ShardTimes("w1", task_start=1.0, compute_start=2.0, compute_end=3.0)]
    with pytest.raises(ValueError, match="1 of 1 shards have no commit recorded"):
        costs_from(shards, flow_start=0.0, flow_end=5.0)


@pytest.mark.integration
def test_shards_that_cannot_all_compute_at_once_are_seen(
    prefect_api, tmp_path, tiny_model, monkeypatch
):
    # Five shards to meet on four workers: the meeting fails (the engine's retry then
    # answers the rows), and the run says so.
    monkeypatch.setattr("tokenmill.bench.fanout_sim.MEET_TIMEOUT_S", 3.0)
    run = run_sleep_fanout(
        workers=4,
        shards_per_worker=2,
        shard_seconds=0.1,
        workdir=tmp_path,
        meet=5,
        model=tiny_model,
    )
    assert not run.met and run.computes > run.num_shards


def _check_exactly_once(run, tmp_path, workers: int) -> None:
    output = str(tmp_path / "out")
    shards = out.completed_shards(output)
    assert run.num_shards == len(shards) >= workers
    # One shard task and one compute per shard (no retry, no second run of any) and
    # one row per id.
    assert sum(run.shards_per_worker.values()) == run.computes == run.num_shards
    assert run.ledger_rows_ok == run.rows
    ids = out.read_results(output).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(run.rows))


@pytest.mark.integration
def test_sixteen_workers_compute_sixteen_shards_at_once_each_once(
    prefect_api, tmp_path, tiny_model
):
    # The first 16 shards compute only once all 16 have started: two on one worker
    # (which runs one at a time) would never all start, and the run would fail.
    run = run_sleep_fanout(
        workers=16,
        shards_per_worker=1,
        shard_seconds=0.1,
        workdir=tmp_path,
        meet=16,
        model=tiny_model,
    )
    assert run.met and len(run.shards_per_worker) == 16
    _check_exactly_once(run, tmp_path, 16)
    assert predict(run).workers_used == 16


# 64 workers on 2 cores: about 2 minutes on a busy machine. The placement and the
# exactly-once it checks are checked at 16 workers by the test above.
@pytest.mark.slow
@pytest.mark.integration
def test_sixty_four_workers_compute_sixty_four_shards_at_once_each_once(
    prefect_api, tmp_path, tiny_model
):
    run = run_sleep_fanout(
        workers=64,
        shards_per_worker=2,
        shard_seconds=0.5,
        workdir=tmp_path,
        meet=64,
        model=tiny_model,
    )
    assert run.met and len(run.shards_per_worker) == 64
    _check_exactly_once(run, tmp_path, 64)
