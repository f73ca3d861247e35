"""The batch flow on a local Dask cluster of 1 and of 2 workers, alternating, on a job of
a few hundred rows; and the progress artifact as the Prefect UI shows it while it runs.

    python benchmarks/dask_fanout.py [--rows 300] [--max-tokens 48] [--rounds 2]
    python benchmarks/dask_fanout.py --operator     # `dask scheduler` + `dask worker`s

With --operator each run gets a fresh cluster started as an operator starts one: a
`dask scheduler` process and N `dask worker --nthreads 1 --resources engine=1`
processes, each pinned (taskset) to its own core, and the flow is given
`--dask-address`; the summary line gives the 2-worker over 1-worker ratio of the
compute spans per round, their median and minimum.

Starts a Prefect server on loopback (or uses PREFECT_API_URL), then runs
`tokenmill flow run ... --dask-workers N --json` for N = 1, 2, 1, 2, ... and prints per
run: the flow's wall seconds, the span of its shards' compute (first shard start to
last shard end, from OUTPUT/shard_stats/), the summed device seconds, and the shards.
While each run goes, the job's progress artifact is read from the API every second;
once 25% of the tokens are done, its ETA is compared with the time that really
remained and its tokens/s with the job's average. Figures go to docs/performance.md.
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


def compute_span(output: Path) -> tuple[float, float, float]:
    """(first shard start to last shard end, summed device seconds, the last end) from
    OUTPUT/shard_stats/."""
    stats = [json.loads(p.read_text()) for p in (output / "shard_stats").glob("*.json")]
    starts = [datetime.fromisoformat(s["started_at"]).timestamp() for s in stats]
    ends = [datetime.fromisoformat(s["finished_at"]).timestamp() for s in stats]
    return max(ends) - min(starts), sum(s["device_seconds"] for s in stats), max(ends)


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
    args = parser.parse_args()
    spans: dict[tuple[int, int], float] = {}
    work = Path(tempfile.mkdtemp(prefix="tokenmill-dask-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    server, api = start_server(work / "server-home")
    os.environ["PREFECT_API_URL"] = api
    source = write_input(work / "in.parquet", args.rows)
    watcher = ArtifactWatcher()
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
                started = time.perf_counter()
                try:
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                finally:
                    wall = time.perf_counter() - started
                    stop(cluster)
                if done.returncode != 0:
                    log = work / f"flow-{workers}-{round_}.log"
                    log.write_text(done.stdout + done.stderr)
                    errors = [line for line in done.stderr.splitlines() if "Error" in line]
                    raise SystemExit(f"flow run failed (log: {log}):\n" + "\n".join(errors[-20:]))
                ledger = json.loads(done.stdout)
                span, device, compute_end = compute_span(out)
                spans[workers, round_] = span
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
                            "progress": eta_check(watcher.seen, key, compute_end, span),
                        }
                    ),
                    flush=True,
                )
        ratios = sorted(spans[1, r] / spans[2, r] for r in range(args.rounds) if spans[2, r])
        if ratios:
            summary = {"ratios_1_over_2": [round(r, 2) for r in ratios]}
            summary |= {"median": round(statistics.median(ratios), 2), "min": round(ratios[0], 2)}
            print(json.dumps(summary), flush=True)
    finally:
        watcher.stop.set()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
