from __future__ import annotations

import pytest

from tokenmill.bench.fanout_model import FanoutCosts, simulate


def test_each_worker_loads_once_beside_the_planning_and_shards_follow_in_order():
    costs = FanoutCosts(dispatch_s=0, engine_load_s=5, commit_s=1, planning_s=2, finalize_s=3)
    run = simulate([10, 10, 10, 10], 2, costs)
    # both workers load from 0 to 5 (planning ends at 2): 5 + 10 + 1 = 16, then
    # 16 + 10 + 1 = 27; the ledger: + 3
    assert run.wall_s == 30 and run.workers_used == 2 and run.compute_s == 40
    assert run.compute_share == pytest.approx(40 / 60)
    one = simulate([10, 10, 10, 10], 1, costs)
    assert one.wall_s == 5 + 4 * 11 + 3
    # planning longer than the load hides it
    slow_plan = FanoutCosts(dispatch_s=0, engine_load_s=5, commit_s=1, planning_s=8)
    assert simulate([10], 1, slow_plan).wall_s == 8 + 10 + 1


def test_the_schedulers_serial_dispatch_caps_the_speed_up():
    costs = FanoutCosts(dispatch_s=0.1, engine_load_s=0, commit_s=0)
    # ten shards a second at most: the last of 100 starts at 10 s, whatever the workers
    runs = [simulate([1.0] * 100, n, costs) for n in (8, 64, 256)]
    # 8 workers: a shard takes its worker 1.1 s (its hand-out, then 1 s); workers 0-3 run
    # 13 shards, worker 3's first ending at 0.4 + 1 s: 1.4 + 12 * 1.1
    assert runs[0].wall_s == pytest.approx(14.6)
    assert runs[1].wall_s == runs[2].wall_s == pytest.approx(11.0)
    assert runs[2].compute_share < runs[1].compute_share


def test_a_worker_without_a_shard_idles():
    run = simulate([4, 4, 4], 8, FanoutCosts(dispatch_s=0, engine_load_s=1, commit_s=0))
    assert run.workers_used == 3 and run.wall_s == 5


def test_bad_costs_refused():
    with pytest.raises(ValueError, match="commit_s must be >= 0"):
        FanoutCosts(dispatch_s=0, engine_load_s=0, commit_s=-1)
    with pytest.raises(ValueError, match="num_workers"):
        simulate([1], 0, FanoutCosts(0, 0, 0))
