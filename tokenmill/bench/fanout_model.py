"""A scale model of the flow's Dask fan-out: what N workers make of a job's shards.

A discrete-event simulation of what the flow does (`flows/batch_flow.py`), from a
few measured per-shard costs, for worker counts no test machine has:

    planning_s       before any shard: the job's plan (the driver's, or the planner's)
    dispatch_s       the scheduler's time to hand one shard task to a worker; the
                     scheduler is one process, so it hands out one task at a time
    engine_load_s    each worker's engine load, begun as the flow starts (beside the
                     planning); a worker's first shard waits for what is left of it
    compute_s        a shard's compute (a part's `device_seconds`, OUTPUT/shard_stats/)
    commit_s         writing a shard's part and stats to the store, on its worker
    finalize_s       after the last shard: the ledger from every part

Workers take shards in the plan's order as each frees up (the `engine` resource hands
a shard to any free engine worker, `flows/runners.py`). The model is the critical
path of that schedule, nothing else: no failures, no stragglers beyond the given
per-shard compute times, a store and network that scale with the workers. Its value
is in the ratios it predicts - where the scheduler's serial dispatch or the one
engine load per worker start to cap the speed-up - to be checked against measured
runs at the worker counts a machine allows.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FanoutCosts:
    """Measured per-shard costs, in seconds (see the module docstring)."""

    dispatch_s: float
    engine_load_s: float
    commit_s: float
    planning_s: float = 0.0
    finalize_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class FanoutRun:
    """One simulated run."""

    num_workers: int
    wall_s: float
    compute_s: float  # the shards' compute, summed
    workers_used: int  # workers that ran at least one shard

    @property
    def compute_share(self) -> float:
        """Of the workers' time from start to end, the share spent computing shards."""
        return self.compute_s / (self.num_workers * self.wall_s) if self.wall_s else 0.0


def simulate(compute_s: Sequence[float], num_workers: int, costs: FanoutCosts) -> FanoutRun:
    """The run of shards with these compute times, in plan order, on `num_workers`.

    Args:
        compute_s: each shard's compute seconds, in the order the flow submits them.
        num_workers: engine workers.
        costs: the per-shard and per-job costs.

    Returns:
        The FanoutRun.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    # (when the worker is free, worker index, whether its engine is loaded)
    free = [(costs.planning_s, w, False) for w in range(num_workers)]
    heapq.heapify(free)
    scheduler_free = costs.planning_s
    end = costs.planning_s
    used = set()
    for seconds in compute_s:
        at, worker, loaded = heapq.heappop(free)
        # The scheduler hands this shard out once the worker is free and the scheduler
        # has handed out the shard before it.
        started = max(at, scheduler_free) + costs.dispatch_s
        scheduler_free = started
        # A worker's engine began loading when the flow started (`preload_engines`).
        computes = started if loaded else max(started, costs.engine_load_s)
        finished = computes + seconds + costs.commit_s
        heapq.heappush(free, (finished, worker, True))
        used.add(worker)
        end = max(end, finished)
    return FanoutRun(num_workers, end + costs.finalize_s, float(sum(compute_s)), len(used))
