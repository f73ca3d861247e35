"""The planner alone on millions of rows read from S3: the driver's peak RSS and the
planning time, by input size and number of workers - the figures the driver's memory
must stay flat on.

    python benchmarks/planner_scale.py [--rows 1000000,10000000] [--rows-per-part 500000]
                                       [--workers 0,1,2] [--smoke]

For each size, a JSON Lines input is written to a loopback S3 store (moto, in this
process) in parts of `--rows-per-part` rows, each part generated and uploaded on its
own, so neither this script nor the store's writer holds the whole file at once; the
store itself keeps the bytes in memory, so each size's input is deleted before the
next is written. The planner then runs in a child process, the driver (read, template,
tokenize, dedupe, order, cut, and the plan files written under a local output): no
engine is loaded, planning only describes the model and uses its tokenizer.

`--workers 0` plans on the driver alone (`plan_job`). N > 0 spreads reading,
templating, tokenizing and the id and copy checks over N workers
(`pipelines/spread_planning.py`) of a cluster started as an operator starts one: a
`dask scheduler` process and N `dask worker` processes of one thread, fresh for each
run. The scheduler is its own process here, as on a real cluster, so the driver's peak
RSS is the planner's alone; the scheduler's and the workers' are printed beside it.
Peaks are `ru_maxrss` (VmHWM for the scheduler). The driver's current RSS is sampled
every half second while it cuts the staged windows (after the last fan-out returns):
"first/min/max/last" of those samples, which stay level where the driver holds one
window at a time whatever the input's size. `--smoke` plans 20,000 rows in windows
of 5,000 to check the script, not to measure.
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
from contextlib import contextmanager

from tokenmill.pipelines.plan import DEFAULT_PLAN_WINDOW_ROWS

CHILD = """
import json, resource, sys, threading, time
from tokenmill.engine import DEFAULT_MODEL
from tokenmill.pipelines.planning import plan_job
from tokenmill.pipelines.spec import JobSpec

def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

samples = []  # (seconds since start, current RSS MB), every half second
def sample(stop):
    while not stop.wait(0.5):
        samples.append((time.perf_counter(), rss_mb()))

source, output, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
workers, window_rows, scheduler_file = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
spec = JobSpec(source, output, model=DEFAULT_MODEL, id_column="id", max_tokens=16,
               storage_options=options, plan_window_rows=window_rows)
workers_rss, cut_started = [], None
stop = threading.Event()
threading.Thread(target=sample, args=(stop,), daemon=True).start()
if workers:
    import importlib
    from distributed import Client
    from tokenmill.flows.runners import DaskFanOut
    from tokenmill.pipelines.spread_planning import plan_job_spread

    class TimedFanOut(DaskFanOut):
        # The driver cuts the staged windows after the last fan-out returns.
        def map(self, fn, args):
            global cut_started
            answers = super().map(fn, args)
            cut_started = time.perf_counter()
            return answers

    with Client(scheduler_file=scheduler_file) as client:
        client.wait_for_workers(workers)
        # A flow's workers have imported tokenmill already: time planning, not imports.
        client.run(importlib.import_module, "tokenmill.pipelines.spread_planning")
        started = time.perf_counter()
        plan = plan_job_spread(spec, fan_out=TimedFanOut(workers))
        seconds = time.perf_counter() - started
        workers_rss = sorted(client.run(peak_rss_mb).values())
else:
    started = time.perf_counter()
    plan = plan_job(spec)
    seconds = time.perf_counter() - started
stop.set()
cut = [mb for t, mb in samples if cut_started is not None and t >= cut_started]
print(json.dumps({"rows": plan.num_rows, "shards": len(plan.shards), "seconds": seconds,
                  "max_rss_mb": peak_rss_mb(), "workers_max_rss_mb": workers_rss,
                  "cut_seconds": None if cut_started is None else time.perf_counter() - cut_started,
                  "cut_rss_mb": [cut[0], min(cut), max(cut), cut[-1]] if cut else None}))
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


@contextmanager
def operator_cluster(work: str, num_workers: int):
    """A `dask scheduler` process and `num_workers` one-thread `dask worker` processes
    (none for 0); yields (scheduler file, scheduler pid) and stops them after."""
    if not num_workers:
        yield "-", None
        return
    scheduler_file = os.path.join(work, f"scheduler-{time.monotonic_ns()}.json")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # this interpreter's dask, so it imports this checkout's tokenmill (a `dask` script
    # on PATH may belong to another environment)
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        + ["--scheduler-file", scheduler_file, "--no-dashboard"],
        **quiet,
    )
    processes = [scheduler]
    try:
        while not os.path.exists(scheduler_file):
            if scheduler.poll() is not None:
                raise SystemExit("the dask scheduler did not start")
            time.sleep(0.2)
        for _ in range(num_workers):
            worker = [sys.executable, "-m", "distributed.cli.dask_worker", "--nthreads", "1"]
            worker += ["--scheduler-file", scheduler_file]
            processes.append(subprocess.Popen(worker + ["--no-dashboard"], **quiet))
        yield scheduler_file, scheduler.pid
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=60)


def peak_rss_of(pid: int) -> float:
    """A running process's peak RSS in MB (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


HEADER = (
    f"{'rows':>11} | {'workers':>7} | {'shards':>6} | {'planning s':>10} | "
    f"{'driver peak RSS MB':>18} | {'cut s':>6} | {'driver RSS in cut MB':>20} | "
    f"{'scheduler MB':>12} | workers' peak RSS MB"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--rows-per-part", type=int, default=500_000)
    parser.add_argument(
        "--workers",
        default="0",
        help="comma-separated worker counts to plan with (0: the driver alone)",
    )
    parser.add_argument("--smoke", action="store_true", help="20,000 rows: checks the script")
    args = parser.parse_args()
    sizes = [20_000] if args.smoke else [int(n) for n in args.rows.split(",")]
    worker_counts = [int(n) for n in args.workers.split(",")]
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
        print(HEADER, flush=True)
        with tempfile.TemporaryDirectory() as work:
            for num_rows in sizes:
                prefix = f"planner-scale/in-{num_rows}"
                write_input(fs, prefix, num_rows, rows_per_part)
                try:
                    for num_workers in worker_counts:
                        output = os.path.join(work, f"out-{num_rows}-{num_workers}")
                        with operator_cluster(work, num_workers) as (scheduler_file, pid):
                            done = subprocess.run(
                                [sys.executable, "-c", CHILD, f"s3://{prefix}/", output]
                                + [json.dumps(options), str(num_workers), str(window_rows)]
                                + [scheduler_file],
                                capture_output=True,
                                text=True,
                                check=False,
                            )
                            scheduler_mb = peak_rss_of(pid) if pid is not None else None
                        if done.returncode != 0:
                            raise SystemExit(
                                f"planning {num_rows:,} rows on {num_workers} workers "
                                f"failed:\n{done.stderr[-3000:]}"
                            )
                        measured = json.loads(done.stdout.strip().splitlines()[-1])
                        workers = ", ".join(f"{mb:.0f}" for mb in measured["workers_max_rss_mb"])
                        scheduler = "-" if scheduler_mb is None else f"{scheduler_mb:.0f}"
                        cut = measured["cut_rss_mb"]
                        cut_rss = "/".join(f"{mb:.0f}" for mb in cut) if cut else "-"
                        cut_s = measured["cut_seconds"]
                        cut_s = "-" if cut_s is None else f"{cut_s:.1f}"
                        print(
                            f"{measured['rows']:>11,} | {num_workers:>7} | "
                            f"{measured['shards']:>6,} | {measured['seconds']:>10.1f} | "
                            f"{measured['max_rss_mb']:>18.0f} | {cut_s:>6} | {cut_rss:>20} | "
                            f"{scheduler:>12} | "
                            f"{workers or '-'}",
                            flush=True,
                        )
                finally:
                    fs.rm(prefix, recursive=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
