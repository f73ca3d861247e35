"""What 1 to 256 Dask workers would make of a 10M-row job, from measured per-shard costs
(`tokenmill/bench/fanout_model.py`: a discrete-event model of the flow's fan-out).

    python benchmarks/fanout_model.py --dispatch-s D --engine-load-s L --commit-s C \\
        [--planning-s P] [--finalize-s F] [--rows 10000000] [--rows-per-shard R] \\
        (--shard-compute-s S | --stats OUTPUT)

Measure the costs first, on a real cluster (`benchmarks/dask_fanout.py --operator`):
D from the scheduler's task start gaps (the flow's task runs: a shard's start minus
the previous shard's end on the same worker, less the plan read), L from the flow's
`tokenmill-workers-<job>` artifact, C from a part's write (OUTPUT/shard_stats/
finished_at minus the compute's end), P and F from the flow's log. `--stats OUTPUT`
takes the compute seconds per row from a finished job's OUTPUT/shard_stats/ and gives
every shard of the 10M-row job that cost; otherwise every shard takes S seconds.
Prints, per worker count: wall hours, speed-up over one worker, the share of the
workers' time spent computing, and the workers that got a shard.
"""

from __future__ import annotations

import argparse
import math

from tokenmill.bench.fanout_model import FanoutCosts, simulate
from tokenmill.pipelines import output as out

WORKERS = (1, 2, 8, 64, 256)


def seconds_per_row(output: str) -> float:
    """Compute seconds per row over a finished job's shards."""
    stats = out.read_shard_stats(output, out.completed_shards(output))
    rows = sum(s.num_rows for s in stats)
    if not rows:
        raise SystemExit(f"{output}: no shard stats")
    return sum(s.device_seconds for s in stats) / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatch-s", type=float, required=True)
    parser.add_argument("--engine-load-s", type=float, required=True)
    parser.add_argument("--commit-s", type=float, required=True)
    parser.add_argument("--planning-s", type=float, default=0.0)
    parser.add_argument("--finalize-s", type=float, default=0.0)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rows-per-shard", type=int, default=2_000)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shard-compute-s", type=float)
    source.add_argument("--stats", metavar="OUTPUT")
    args = parser.parse_args()
    num_shards = math.ceil(args.rows / args.rows_per_shard)
    if args.stats:
        compute = seconds_per_row(args.stats) * args.rows_per_shard
    else:
        compute = args.shard_compute_s
    costs = FanoutCosts(
        dispatch_s=args.dispatch_s,
        engine_load_s=args.engine_load_s,
        commit_s=args.commit_s,
        planning_s=args.planning_s,
        finalize_s=args.finalize_s,
    )
    print(f"{args.rows:,} rows in {num_shards:,} shards of {compute:.2f} s compute; {costs}")
    base = None
    for workers in WORKERS:
        run = simulate([compute] * num_shards, workers, costs)
        base = base or run.wall_s
        print(
            f"{workers:4d} workers: {run.wall_s / 3600:8.2f} h, {base / run.wall_s:6.1f}x, "
            f"computing {run.compute_share:.0%} of the workers' time, "
            f"{run.workers_used} workers used"
        )


if __name__ == "__main__":
    main()
