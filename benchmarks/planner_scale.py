"""The planner alone on millions of rows read from S3: its process's peak RSS and its
time, by input size - the figures the driver's memory must stay flat on.

    python benchmarks/planner_scale.py [--rows 1000000,10000000] [--rows-per-part 500000]
                                       [--workers N] [--smoke]

For each size, a JSON Lines input is written to a loopback S3 store (moto, in this
process) in parts of `--rows-per-part` rows, each part generated and uploaded on its
own, so neither this script nor the store's writer holds the whole file at once; the
store itself keeps the bytes in memory, so each size's input is deleted before the
next is written. `plan_job` then runs in a child process (read, template, tokenize,
dedupe, order, cut, and the plan files written under a local output): no engine is
loaded, planning only describes the model and uses its tokenizer. Printed per size:
rows, shards, seconds and the child's peak RSS (`ru_maxrss`). `--workers N` plans with
reading, templating and tokenizing spread over a local Dask cluster of N worker
processes (`pipelines/spread_planning.py`), and prints the driver's peak RSS (the child,
which also runs the cluster's scheduler) apart from each worker's. `--smoke` plans
20,000 rows in windows of 5,000 to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from tokenmill.pipelines.plan import DEFAULT_PLAN_WINDOW_ROWS

CHILD = """
import json, resource, sys, time
from tokenmill.engine import DEFAULT_MODEL
from tokenmill.pipelines.planning import plan_job
from tokenmill.pipelines.spec import JobSpec

def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

source, output, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
workers, window_rows = int(sys.argv[4]), int(sys.argv[5])
spec = JobSpec(source, output, model=DEFAULT_MODEL, id_column="id", max_tokens=16,
               storage_options=options, plan_window_rows=window_rows)
workers_rss = []
if workers:
    import importlib
    from distributed import Client, LocalCluster
    from tokenmill.flows.runners import DaskFanOut
    from tokenmill.pipelines.spread_planning import plan_job_spread
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        # A flow's workers have imported tokenmill already: time planning, not imports.
        client.run(importlib.import_module, "tokenmill.pipelines.spread_planning")
        started = time.perf_counter()
        plan = plan_job_spread(spec, fan_out=DaskFanOut(workers))
        seconds = time.perf_counter() - started
        workers_rss = sorted(client.run(peak_rss_mb).values())
else:
    started = time.perf_counter()
    plan = plan_job(spec)
    seconds = time.perf_counter() - started
print(json.dumps({"rows": plan.num_rows, "shards": len(plan.shards), "seconds": seconds,
                  "max_rss_mb": peak_rss_mb(), "workers_max_rss_mb": workers_rss}))
"""

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def write_input(fs, prefix: str, num_rows: int, rows_per_part: int) -> None:
    """Rows of a few hundred questions on a few dozen shared instructions, part by part."""
    for start in range(0, num_rows, rows_per_part):
        with fs.open(f"{prefix}/part-{start // rows_per_part:05d}.jsonl", "wb") as f:
            lines = (
                json.dumps(
                    {
                        "id": f"row-{i}",
                        "prompt": f"Instruction {i % 37}: answer briefly. Question {i}: "
                        f"what follows {i % 997} in the series?",
                    }
                )
                + "\n"
                for i in range(start, min(num_rows, start + rows_per_part))
            )
            f.write("".join(lines).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--rows-per-part", type=int, default=500_000)
    parser.add_argument(
        "--workers", type=int, default=0, help="spread over N Dask workers (0: the driver alone)"
    )
    parser.add_argument("--smoke", action="store_true", help="20,000 rows: checks the script")
    args = parser.parse_args()
    sizes = [20_000] if args.smoke else [int(n) for n in args.rows.split(",")]
    rows_per_part = 10_000 if args.smoke else args.rows_per_part
    # The smoke run's input in 4 windows, so each of 2 workers plans some.
    window_rows = 5_000 if args.smoke else DEFAULT_PLAN_WINDOW_ROWS

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_port}"
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("planner-scale")
        with tempfile.TemporaryDirectory() as work:
            for num_rows in sizes:
                prefix = f"planner-scale/in-{num_rows}"
                started = time.perf_counter()
                write_input(fs, prefix, num_rows, rows_per_part)
                written = time.perf_counter() - started
                done = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        f"s3://{prefix}/",
                        os.path.join(work, f"out-{num_rows}"),
                        json.dumps(options),
                        str(args.workers),
                        str(window_rows),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                fs.rm(prefix, recursive=True)
                if done.returncode != 0:
                    raise SystemExit(f"planning {num_rows:,} rows failed:\n{done.stderr[-3000:]}")
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                workers = measured["workers_max_rss_mb"]
                spread = (
                    f" on {len(workers)} workers (peak RSS "
                    + ", ".join(f"{mb:.0f}" for mb in workers)
                    + " MB)"
                    if workers
                    else ""
                )
                print(
                    f"{measured['rows']:>11,} rows: {measured['shards']:,} shards, planned in "
                    f"{measured['seconds']:.1f} s{spread} (input written in {written:.1f} s), "
                    f"driver peak RSS {measured['max_rss_mb']:.0f} MB"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
