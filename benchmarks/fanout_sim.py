"""The batch flow on 64 Dask workers with a sleeping engine, on this machine: the fan-out's
coordination costs measured, and the scale model's wall for them set beside the
measured wall (`tokenmill/bench/fanout_sim.py`).

    python benchmarks/fanout_sim.py [--workers 16,64] [--shards-per-worker 4]
                                    [--shard-seconds 2.0]

Each worker is a thread of this process (an in-process Dask cluster, one `engine`
resource per worker) whose engine sleeps `--shard-seconds` per shard, so the cores go
to the orchestration: the real flow, plan, Prefect task runs, part commits and ledger.
Needs a Prefect API (PREFECT_API_URL) and the default model's tokenizer. Prints per
worker count one JSON line: the run (shards, wall, workers used, the costs read from
it: `ShardCosts`), the wall of the shards' compute alone, and the scale model's wall
for the measured costs. On a machine with few cores all 64 workers' Python shares one
interpreter lock: the measured wall is an upper bound of a real cluster's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

from tokenmill.bench.fanout_sim import predict, run_sleep_fanout


def process_cpu_s(pid: int | None) -> float:
    """A process's CPU seconds and its waited-for children's, from /proc (0 without one)."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime, cutime, cstime: fields 14-17 of stat(5), after the command's ")"
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64")
    parser.add_argument("--shards-per-worker", type=int, default=4)
    parser.add_argument("--shard-seconds", type=float, default=2.0)
    parser.add_argument(
        "--server-pid", type=int, help="the Prefect server's pid: its CPU seconds per run too"
    )
    args = parser.parse_args()
    # Hundreds of task runs' INFO lines would cost more than the runs: warnings only.
    logging.getLogger("prefect").setLevel(logging.WARNING)
    for workers in (int(w) for w in args.workers.split(",")):
        server_cpu = process_cpu_s(args.server_pid)
        with tempfile.TemporaryDirectory(prefix="tokenmill-fanout-sim-") as tmp:
            run = run_sleep_fanout(
                workers=workers,
                shards_per_worker=args.shards_per_worker,
                shard_seconds=args.shard_seconds,
                workdir=Path(tmp),
            )
        ideal = -(-run.num_shards // workers) * run.shard_seconds
        line = {
            **run.as_dict(),
            "compute_only_wall_s": ideal,
            "model_wall_s": round(predict(run).wall_s, 3),
        }
        if args.server_pid:
            line["server_cpu_s"] = round(process_cpu_s(args.server_pid) - server_cpu, 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
