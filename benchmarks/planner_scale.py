"""The planner alone on millions of rows read from S3: the driver's peak RSS and the
planning time, by input size and number of workers - the figures the driver's memory
must stay flat on.

    python benchmarks/planner_scale.py [--rows 1000000,10000000] [--rows-per-part 500000]
                                       [--workers 0,1,2] [--pin] [--no-dedupe] [--smoke]

For each size, a JSON Lines input is written to a loopback S3 store (moto, in this
process) in parts of `--rows-per-part` rows, each part generated and uploaded on its
own, so neither this script nor the store's writer holds the whole file at once; the
store itself keeps the bytes in memory, so each size's input is deleted before the
next is written. The planner then runs in a child process, the driver (read, template,
tokenize, dedupe, order, cut, and the plan files written under a local output): no
engine is loaded, planning only describes the model and uses its tokenizer.

`--workers 0` plans on the driver alone (`plan_job`). N > 0 spreads reading,
templating, tokenizing, the id and copy checks and a deduping job's cut over N workers
(`pipelines/spread_planning.py`) of a cluster started as an operator starts one: a
`dask scheduler` process and N `dask worker` processes of one thread, fresh for each
run; with `--pin` each worker is pinned to a core of its own (taskset), so W workers
have W cores (`flows/runners.py` holds a worker's tokenizer threads to its share of the
cores it may run on: unpinned, one worker alone tokenizes on every core). The scheduler
is its own process here, as on a real cluster, so the driver's peak RSS is the
planner's alone; the scheduler's and the workers' are printed beside it.
Peaks are each process's VmHWM (not `ru_maxrss`, which Linux carries over from the
process that spawned it: this script, whose S3 store holds the whole input). The driver's current RSS is sampled
every 0.2 s over the whole plan, by phase (opening and describing the model, each
fan-out, the cut, after it); under each row, each phase's seconds, its RSS range and
the driver's peak by its end, so the phase that raised the peak is the first whose
"peak by its end" is the final one. "cut s" and "driver RSS in cut" are the cut's
alone: where the job dedupes, the workers' two rounds of it after the last part and the
id buckets (a window's copies are decided over the whole input: `spread_cut.py`; on
the driver with `--workers 0`), and with `--no-dedupe` the windows the driver cut after
the last part came in (the others are cut while later parts stage, in the "read_part +
cut" phase). CPU
seconds are by role, each process's own: the driver's and the workers' over the plan,
the scheduler's over its whole life. `--smoke` plans 20,000 rows in windows of 5,000
to check the script, not to measure.
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
    # VmHWM, this process's own: ru_maxrss also counts the process that spawned it
    # (Linux hands a vfork parent's peak to its exec'ed child), here the script that
    # holds the whole input in its S3 store
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))

def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

# The driver's phases in order: each one's RSS samples (every 0.2 s) and the peak RSS
# reached by its end (ru_maxrss only rises: the phase whose end raised it set it).
phases = [["start", [], 0.0, time.perf_counter()]]
def enter(name):
    phases[-1][2] = peak_rss_mb()
    if phases[-1][0] != name:
        phases.append([name, [], 0.0, time.perf_counter()])
def sample(stop):
    while not stop.wait(0.2):
        phases[-1][1].append(rss_mb())

source, output, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
workers, window_rows, scheduler_file = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
spec = JobSpec(source, output, model=DEFAULT_MODEL, id_column="id", max_tokens=16,
               storage_options=options, plan_window_rows=window_rows,
               dedupe=sys.argv[7] == "dedupe")
workers_rss, workers_cpu = [], []
stop = threading.Event()
threading.Thread(target=sample, args=(stop,), daemon=True).start()
import tokenmill.pipelines.spread_planning as spread
import tokenmill.pipelines.planning as planning
for module in (spread, planning):  # the cut: plan_windows, wherever it is called from
    plan_windows = module.plan_windows
    def cut(*a, _plan_windows=plan_windows, **k):
        enter("cut")
        return _plan_windows(*a, **k)
    module.plan_windows = cut
driver_cpu = cpu_s()
if workers:
    import importlib
    from distributed import Client
    from tokenmill.flows.runners import DaskFanOut

    class PhasedFanOut(DaskFanOut):
        def map(self, fn, args):
            enter(fn.__name__)
            answers = super().map(fn, args)
            enter("after " + fn.__name__)
            return answers

        def imap(self, fn, args):  # the cut runs between its answers
            enter(fn.__name__ + " + cut")
            yield from super().imap(fn, args)
            enter("cut")

    with Client(scheduler_file=scheduler_file) as client:
        client.wait_for_workers(workers)
        # A flow's workers have imported tokenmill already: time planning, not imports.
        client.run(importlib.import_module, "tokenmill.pipelines.spread_planning")
        before = client.run(cpu_s)
        enter("prepare")
        driver_cpu = cpu_s()
        started = time.perf_counter()
        plan = spread.plan_job_spread(spec, fan_out=PhasedFanOut(workers))
        seconds = time.perf_counter() - started
        driver_cpu = cpu_s() - driver_cpu
        enter("done")
        workers_rss = sorted(client.run(peak_rss_mb).values())
        workers_cpu = sorted(a - before[w] for w, a in client.run(cpu_s).items())
else:
    started = time.perf_counter()
    plan = plan_job(spec)
    seconds = time.perf_counter() - started
    driver_cpu = cpu_s() - driver_cpu
    enter("done")
stop.set()
# the cut: the driver's, or the workers' rounds (`spread_cut.py`) and what is between
def of_cut(name):
    return name.removeprefix("after ") in ("cut", "cut_windows", "place_windows")
cut = [mb for name, samples, *_ in phases if of_cut(name) for mb in samples]
print(json.dumps({"rows": plan.num_rows, "shards": len(plan.shards), "seconds": seconds,
                  "max_rss_mb": peak_rss_mb(), "workers_max_rss_mb": workers_rss,
                  "driver_cpu_s": driver_cpu, "workers_cpu_s": workers_cpu,
                  "cut_rss_mb": [cut[0], min(cut), max(cut), cut[-1]] if cut else None,
                  "cut_seconds": sum(b[3] - a[3] for a, b in zip(phases, phases[1:])
                                     if of_cut(a[0])) or None,
                  # (phase, seconds, min and max RSS sampled, peak RSS by its end)
                  "phases": [[a[0], b[3] - a[3], min(a[1], default=None),
                              max(a[1], default=None), a[2]]
                             for a, b in zip(phases, phases[1:])]}))
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
def operator_cluster(work: str, num_workers: int, pin: bool = False):
    """A `dask scheduler` process and `num_workers` one-thread `dask worker` processes
    (none for 0), each pinned to a core of its own where `pin` (taskset); yields
    (scheduler file, scheduler pid) and stops them after."""
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
        cores = sorted(os.sched_getaffinity(0))
        for i in range(num_workers):
            worker = [sys.executable, "-m", "distributed.cli.dask_worker", "--nthreads", "1"]
            worker += ["--scheduler-file", scheduler_file]
            if pin:
                worker = ["taskset", "-c", str(cores[i % len(cores)]), *worker]
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


def cpu_seconds_of(pid: int) -> float:
    """A running process's user + system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


HEADER = (
    f"{'rows':>11} | {'workers':>7} | {'shards':>6} | {'planning s':>10} | "
    f"{'driver peak RSS MB':>18} | {'cut s':>6} | {'driver RSS in cut MB':>20} | "
    f"{'scheduler MB':>12} | workers' peak RSS MB | CPU s: driver, scheduler, workers"
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
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each worker on a core of its own (taskset), as an operator pins them",
    )
    parser.add_argument("--smoke", action="store_true", help="20,000 rows: checks the script")
    parser.add_argument(
        "--no-dedupe",
        action="store_true",
        help="plan without dedupe: the cut then runs while the parts stage",
    )
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
                        with operator_cluster(work, num_workers, args.pin) as (
                            scheduler_file,
                            pid,
                        ):
                            done = subprocess.run(
                                [sys.executable, "-c", CHILD, f"s3://{prefix}/", output]
                                + [json.dumps(options), str(num_workers), str(window_rows)]
                                + [scheduler_file, "no" if args.no_dedupe else "dedupe"],
                                capture_output=True,
                                text=True,
                                check=False,
                            )
                            scheduler_mb = peak_rss_of(pid) if pid is not None else None
                            # its whole life: its start and the client's are a second or so
                            scheduler_cpu = cpu_seconds_of(pid) if pid is not None else None
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
                            f"{workers or '-'} | {measured['driver_cpu_s']:.1f}, "
                            + ("-" if scheduler_cpu is None else f"{scheduler_cpu:.1f}")
                            + ", "
                            + (", ".join(f"{s:.1f}" for s in measured["workers_cpu_s"]) or "-"),
                            flush=True,
                        )
                        # where the driver's peak was reached: the phase whose end raised it
                        for name, seconds, low, high, peak in measured["phases"]:
                            rss = "-" if low is None else f"{low:.0f}-{high:.0f}"
                            print(
                                f"    {name:<22} {seconds:>8.1f} s  RSS {rss:>9} MB  "
                                f"peak by its end {peak:.0f} MB",
                                flush=True,
                            )
                finally:
                    fs.rm(prefix, recursive=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
