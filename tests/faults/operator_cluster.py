"""A Dask cluster started the way an operator starts one: a `dask scheduler` process and
`dask worker` processes (`--nthreads 1 --resources engine=1`, each under a nanny and
pinned to its own CPU where the machine has enough), on loopback.

Each runs as `python -m distributed.cli.dask_scheduler` / `dask_worker` with the tests'
own interpreter, so it imports this checkout's tokenmill (a `dask` script on PATH may
belong to another environment). The workers import the fault hooks from tests/faults/
(PYTHONPATH), inherit the
environment (PREFECT_API_URL, TOKENMILL_CACHE_DIR), and are stopped at the end by the
process handles this module started - never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent
TESTS_DIR = FAULTS_DIR.parent
START_TIMEOUT_S = 120


@dataclass
class OperatorCluster:
    address: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen]


@contextlib.contextmanager
def operator_cluster(
    workdir: Path,
    num_workers: int = 2,
    *,
    resources: str | None = "engine=1",
    nanny: bool = True,
) -> Iterator[OperatorCluster]:
    """Start the scheduler and `num_workers` workers; yield once all have joined.

    Args:
        resources: each worker's `--resources` (None: none offered).
        nanny: False starts workers with `--no-nanny`: a killed one never comes back.
    """
    from distributed import Client

    workdir.mkdir(parents=True, exist_ok=True)
    scheduler_file = workdir / "scheduler.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(FAULTS_DIR), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
        ),
    }
    logs = []

    def start(name: str, args: list[str], cpu: int | None = None) -> subprocess.Popen:
        log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed at the end
        logs.append(log)
        command = [sys.executable, "-m", f"distributed.cli.dask_{args[0]}", *args[1:]]
        if cpu is not None:
            command = ["taskset", "-c", str(cpu), *command]
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    scheduler = start(
        "scheduler",
        [
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
        ],
    )
    workers: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        cores = sorted(os.sched_getaffinity(0))
        for i in range(num_workers):
            args = [
                "worker",
                "--scheduler-file",
                str(scheduler_file),
                "--nthreads",
                "1",
                "--nworkers",
                "1",
                "--no-dashboard",
                "--name",
                f"w{i}",
            ]
            if resources:
                args += ["--resources", resources]
            if not nanny:
                args.append("--no-nanny")
            cpu = cores[i] if len(cores) >= num_workers else None
            workers.append(start(f"worker{i}", args, cpu))
        with Client(scheduler_file=str(scheduler_file), timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(num_workers, timeout=START_TIMEOUT_S)
            address = client.scheduler.address
        yield OperatorCluster(address, scheduler, workers)
    finally:
        for process in [*workers, scheduler]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*workers, scheduler]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
