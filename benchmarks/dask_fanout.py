"""The batch flow on a local Dask cluster of 1 and of 2 workers, alternating, on a job of
a few hundred rows; and the progress artifact as the Prefect UI shows it while it runs.

    python benchmarks/dask_fanout.py [--rows 300] [--max-tokens 48] [--rounds 2]
    python benchmarks/dask_fanout.py --operator     # `dask scheduler` + `dask worker`s

With --operator each run gets a fresh cluster started as an operator starts one: a
`dask scheduler` process and N `dask worker --nthreads 1 --resources engine=1`
processes, each pinned (taskset) to its own core, and the flow is given
`--dask-address`; the summary line gives the 2-worker over 1-worker ratio of the
compute spans per round, their median and minimum.

Each run also gives the CPU seconds each role used within its compute span (workers,
`dask scheduler`, the flow's driver process, the Prefect server, this script's progress
reader), sampled from /proc. Where the machine has as many cores as the run has workers,
what the other roles use in the span is taken from the engines: with W seconds of
engine work in the 1-worker span S1 and O seconds of the others' in the 2-worker span,
the 2 workers need at least (W + O) / 2 seconds, so S1 / S2 <= 2 S1 / (W + O)
(`bound_1_over_2` per round).

Starts a Prefect server on loopback (or uses PREFECT_API_URL), then runs
`tokenmill flow run ... --dask-workers N --json` for N = 1, 2, 1, 2, ... and prints per
run: the flow's wall seconds, the span of its shards' compute (first shard start to
last shard end, from OUTPUT/shard_stats/; copy shards included), the summed device
seconds, the shards, and the run's split (`split_s`, seconds from the flow's start):
planning done, each compute shard's start and end, the last copy shard's end, and the
ledger's end (finalize).
While each run goes, the job's progress artifact is read from the API every second;
once 25% of the tokens are done, its ETA is compared with the time that really
remained and its tokens/s with the job's average (`--no-watch` leaves that reader off:
it queries the server every second, as an open Prefect UI would). Figures go to
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from forecast_check import write_input  # noqa: E402

TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))
PROGRESS = re.compile(r"([\d,]+) of ([\d,]+) tokens .*?; ([\d,]+) tok/s; ETA ([\d,]+) s")


def start_server(home: Path) -> tuple[subprocess.Popen | None, str]:
    if os.environ.get("PREFECT_API_URL"):
        return None, os.environ["PREFECT_API_URL"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home)}
    server = subprocess.Popen(
        [
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--analytics-off",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2):
                return server, api
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the Prefect server did not start")


class ArtifactWatcher(threading.Thread):
    """Reads the progress artifacts of the server every second: (time, key, description)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: list[tuple[float, str, float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from prefect import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

        while not self.stop.is_set():
            try:
                with get_client(sync_client=True) as client:
                    found = client.read_artifacts(
                        artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"]))
                    )
                now = time.time()
                for a in found:
                    self.seen.append((now, a.key, float(a.data), a.description or ""))
            except Exception:  # the server is busy: try again
                pass
            self.stop.wait(1.0)


def start_operator_cluster(work: Path, workers: int) -> tuple[list[subprocess.Popen], str]:
    """`dask scheduler` and `workers` pinned `dask worker` processes; their address."""
    from distributed import Client

    scheduler_file = work / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    base = [
        sys.executable,
        "-m",
        "distributed.cli.dask_scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-dashboard",
    ]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    processes = [subprocess.Popen([*base, "--scheduler-file", str(scheduler_file)], **quiet)]
    while not scheduler_file.exists():
        time.sleep(0.2)
    cores = sorted(os.sched_getaffinity(0))
    for i in range(workers):
        worker = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            "--scheduler-file",
            str(scheduler_file),
            "--nthreads",
            "1",
        ]
        worker += ["--resources", "engine=1", "--no-dashboard", "--name", f"w{i}"]
        processes.append(
            subprocess.Popen(["taskset", "-c", str(cores[i % len(cores)]), *worker], **quiet)
        )
    with Client(scheduler_file=str(scheduler_file), timeout=120) as client:
        client.wait_for_workers(workers, timeout=120)
        address = client.scheduler.address
    return processes, address


def stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds) of every process now alive."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(proc.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return found


def thread_cpu_seconds(tid: int) -> float:
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(api: str) -> list[int]:
    """The processes of the Prefect server serving `api` (started here or shared)."""
    port = api.split(":")[-1].split("/")[0]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            words = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "server" in words and "start" in words and port in words:
            found.append(int(proc.name))
    return found


class CpuSampler(threading.Thread):
    """Samples the CPU seconds of each role's processes and all their descendants (a
    `dask worker`'s nanny runs the worker in a child) twice a second, so the seconds
    within any interval (the compute span) can be read back. The progress reader is a
    thread of this script, sampled on its own."""

    def __init__(self, roles: dict[str, list[int]], reader_thread: int | None) -> None:
        super().__init__(daemon=True)
        self.roles = roles
        self.reader_thread = reader_thread
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.last: dict[int, float] = {}  # a process that ended keeps its last reading
        self.members: dict[str, set[int]] = {role: set(pids) for role, pids in roles.items()}
        self.stop = threading.Event()

    def sample(self) -> None:
        alive = processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, seconds) in alive.items():
            children.setdefault(parent, []).append(pid)
            self.last[pid] = seconds
        totals = {}
        for role, members in self.members.items():
            todo = list(members)
            while todo:
                for child in children.get(todo.pop(), []):
                    if child not in members:
                        members.add(child)
                        todo.append(child)
            totals[role] = sum(self.last.get(pid, 0.0) for pid in members)
        if self.reader_thread is not None:
            totals["watcher"] = thread_cpu_seconds(self.reader_thread)
        self.samples.append((time.time(), totals))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(0.5)
        self.sample()

    def within(self, start: float, end: float) -> dict[str, float]:
        """Each role's CPU seconds between two wall-clock times (interpolated)."""

        def at(when: float, role: str) -> float:
            points = [(t, totals[role]) for t, totals in self.samples]
            for (t0, v0), (t1, v1) in zip(points, points[1:]):
                if t0 <= when <= t1:
                    return v0 + (v1 - v0) * ((when - t0) / (t1 - t0) if t1 > t0 else 0.0)
            return points[0][1] if when < points[0][0] else points[-1][1]

        return {role: round(at(end, role) - at(start, role), 1) for role in self.samples[0][1]}


def compute_span(output: Path) -> tuple[float, float, float]:
    """(first shard start to last shard end, summed device seconds, the last end) from
    OUTPUT/shard_stats/."""
    stats = [json.loads(p.read_text()) for p in (output / "shard_stats").glob("*.json")]
    starts = [datetime.fromisoformat(s["started_at"]).timestamp() for s in stats]
    ends = [datetime.fromisoformat(s["finished_at"]).timestamp() for s in stats]
    return max(ends) - min(starts), sum(s["device_seconds"] for s in stats), max(ends)


def span_split(output: Path, flow_started: float, ledger: dict) -> dict:
    """Where a run's time went, in seconds from the flow process's start: planning done
    (OUTPUT/_cut.json written, after planning and the output check), each compute
    shard's start and end, the first start and last end of the compute shards, the copy
    shards' last end, the ledger's end (finalize) - so a ratio of compute spans shows
    which serial pieces it holds."""

    def at(iso: str) -> float:
        return round(datetime.fromisoformat(iso).timestamp() - flow_started, 2)

    stats = [json.loads(p.read_text()) for p in (output / "shard_stats").glob("*.json")]
    compute = sorted(
        (at(s["started_at"]), at(s["finished_at"]))
        for s in stats
        if not s["shard_id"].startswith("copies-")
    )
    copies = [at(s["finished_at"]) for s in stats if s["shard_id"].startswith("copies-")]
    last_compute = max(end for _, end in compute)
    return {
        "planned": round((output / "_cut.json").stat().st_mtime - flow_started, 2),
        "compute_shards": compute,
        "first_shard_start": compute[0][0],
        "last_compute_end": last_compute,
        "copies_end": max(copies) if copies else None,
        "copies_after_compute_s": round(max(copies) - last_compute, 2) if copies else None,
        "ledger_end": at(ledger["finished_at"]),
    }


def eta_check(seen: list, key: str, end: float, span: float) -> dict | None:
    """The first artifact reading at >= 25% of the tokens: its ETA against the compute
    time that remained (to the last shard's end), its tokens/s against the job's average
    (all its tokens over its compute span)."""
    readings = []
    for at, k, _, text in seen:
        m = PROGRESS.search(text) if k == key else None
        if m:
            done, total, rate, eta = (int(g.replace(",", "")) for g in m.groups())
            readings.append((at, done, total, rate, eta))
    if not readings:
        return None
    average = readings[-1][2] / span if span > 0 else None
    for at, done, total, rate, eta in readings:
        if total and done >= 0.25 * total and done < total:
            remaining = end - at
            return {
                "share": round(done / total, 3),
                "eta_s": eta,
                "remaining_s": round(remaining, 1),
                "eta_over_remaining": round(eta / remaining, 2) if remaining > 0 else None,
                "tokens_per_s": rate,
                "job_average_tokens_per_s": round(average, 1) if average else None,
                "rate_over_average": round(rate / average, 2) if average else None,
                "readings": len(readings),
            }
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--operator", action="store_true", help="dask scheduler + pinned dask worker processes"
    )
    parser.add_argument(
        "--no-watch", action="store_true", help="do not read the progress artifacts while runs go"
    )
    args = parser.parse_args()
    spans: dict[tuple[int, int], float] = {}
    others: dict[tuple[int, int], float] = {}  # CPU seconds of all but the workers, in span
    engine_work: dict[tuple[int, int], float] = {}  # the workers' CPU seconds, in span
    work = Path(tempfile.mkdtemp(prefix="tokenmill-dask-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    server, api = start_server(work / "server-home")
    os.environ["PREFECT_API_URL"] = api
    source = write_input(work / "in.parquet", args.rows)
    watcher = ArtifactWatcher()
    if not args.no_watch:
        watcher.start()
    try:
        for round_ in range(args.rounds):
            for workers in (1, 2):
                out = work / f"out-{workers}-{round_}"
                command = [TOKENMILL, "flow", "run", str(source), str(out), "--id-column", "id"]
                command += ["--max-tokens", str(args.max_tokens)]
                command += ["--price-input", "0.15", "--price-output", "0.6", "--json"]
                cluster: list[subprocess.Popen] = []
                if args.operator:
                    cluster, address = start_operator_cluster(work, workers)
                    command += ["--dask-address", address]
                else:
                    command += ["--dask-workers", str(workers)]
                started, flow_started = time.perf_counter(), time.time()
                driver = subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
                roles = {
                    "workers": [p.pid for p in cluster[1:]],
                    "scheduler": [p.pid for p in cluster[:1]],
                    "driver": [driver.pid],
                    "server": server_pids(api),
                }
                sampler = CpuSampler(roles, watcher.native_id)
                sampler.start()
                try:
                    stdout, stderr = driver.communicate()
                    done = subprocess.CompletedProcess(command, driver.returncode, stdout, stderr)
                finally:
                    wall = time.perf_counter() - started
                    sampler.stop.set()
                    sampler.join()
                    stop(cluster)
                if done.returncode != 0:
                    log = work / f"flow-{workers}-{round_}.log"
                    log.write_text(done.stdout + done.stderr)
                    errors = [line for line in done.stderr.splitlines() if "Error" in line]
                    raise SystemExit(f"flow run failed (log: {log}):\n" + "\n".join(errors[-20:]))
                ledger = json.loads(done.stdout)
                span, device, compute_end = compute_span(out)
                spans[workers, round_] = span
                in_span = sampler.within(compute_end - span, compute_end)
                others[workers, round_] = sum(v for k, v in in_span.items() if k != "workers")
                engine_work[workers, round_] = in_span["workers"]
                key = f"tokenmill-progress-{ledger['job_id']}"
                print(
                    json.dumps(
                        {
                            "workers": workers,
                            "round": round_,
                            "flow_wall_s": round(wall, 1),
                            "compute_span_s": round(span, 1),
                            "device_seconds_sum": round(device, 1),
                            "shards": ledger["num_shards"],
                            "rows": ledger["rows_ok"] + ledger["rows_failed"],
                            "load_average": round(os.getloadavg()[0], 1),
                            "cpu_seconds_in_span": in_span,
                            "split_s": span_split(out, flow_started, ledger),
                            "progress": eta_check(watcher.seen, key, compute_end, span),
                        }
                    ),
                    flush=True,
                )
        rounds = [r for r in range(args.rounds) if spans[2, r]]
        ratios = sorted(spans[1, r] / spans[2, r] for r in rounds)
        if ratios:
            summary = {"ratios_1_over_2": [round(r, 2) for r in ratios]}
            summary |= {"median": round(statistics.median(ratios), 2), "min": round(ratios[0], 2)}
            if args.operator and len(os.sched_getaffinity(0)) == 2:
                bounds = [
                    2 * spans[1, r] / (engine_work[1, r] + others[2, r])
                    for r in rounds
                    if engine_work[1, r] + others[2, r] > 0
                ]
                summary["bound_1_over_2"] = [round(b, 2) for b in bounds]
            print(json.dumps(summary), flush=True)
    finally:
        watcher.stop.set()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
