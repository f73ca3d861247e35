"""A Dask cluster started the way an operator starts one: a `dask scheduler` process and
`dask worker` processes (`--nthreads 1 --resources engine=1`, each under a nanny and
pinned to its own CPU where the machine has enough), on loopback.

Each runs as `python -m distributed.cli.dask_scheduler` / `dask_worker` with the tests'
own interpreter, so it imports this checkout's tokenmill (a `dask` script on PATH may
belong to another environment). The workers import the fault hooks from tests/faults/
(PYTHONPATH), inherit the
environment (PREFECT_API_URL, TOKENMILL_CACHE_DIR), and are stopped at the end by the
process handles this module started - never by name.

`OperatorCluster.restart_scheduler()` SIGKILLs the scheduler and starts a fresh one on the
same address. A `dask worker` (2026.x) closes, nanny included, when it loses its
scheduler rather than waiting for it, so the restart also starts again every worker that
exited - what an operator's supervisor (systemd, Kubernetes) does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent
TESTS_DIR = FAULTS_DIR.parent
START_TIMEOUT_S = 120


@dataclass
class OperatorCluster:
    address: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen]
    _start_scheduler: Callable[[int], subprocess.Popen] = field(repr=False)
    _start_worker: Callable[[int], subprocess.Popen] = field(repr=False)

    def restart_scheduler(self) -> None:
        """SIGKILL the scheduler, start a new one on the same port, and start again the
        workers that exited with the old one; returns once they have all joined."""
        from distributed import Client

        self.scheduler.kill()
        self.scheduler.wait()
        port = int(self.address.rsplit(":", 1)[1])
        self.scheduler = self._start_scheduler(port)
        for i, worker in enumerate(self.workers):
            try:
                worker.wait(timeout=30)  # it closes on losing its scheduler
            except subprocess.TimeoutExpired:
                continue  # still connected somehow: leave it be
            self.workers[i] = self._start_worker(i)
        with Client(self.address, timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(len(self.workers), timeout=START_TIMEOUT_S)


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

    starts = {"scheduler": 0}

    def start_scheduler(port: int) -> subprocess.Popen:
        scheduler_file.unlink(missing_ok=True)
        starts["scheduler"] += 1
        args = ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
        process = start(
            f"scheduler{starts['scheduler']}", [*args, "--scheduler-file", str(scheduler_file)]
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return process

    def start_worker(i: int) -> subprocess.Popen:
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
        starts[i] = starts.get(i, 0) + 1
        return start(f"worker{i}-{starts[i]}", args, cpu)

    cores = sorted(os.sched_getaffinity(0))
    cluster = OperatorCluster("", start_scheduler(0), [], start_scheduler, start_worker)
    try:
        cluster.workers.extend(start_worker(i) for i in range(num_workers))
        with Client(scheduler_file=str(scheduler_file), timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(num_workers, timeout=START_TIMEOUT_S)
            cluster.address = client.scheduler.address
        yield cluster
    finally:
        processes = [*cluster.workers, cluster.scheduler]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
