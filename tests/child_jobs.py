"""Jobs run in a child process and killed midway (SIGKILL), for the resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def published_parts(results_dir: Path) -> dict[str, int]:
    """A job's published result parts (hidden temp files excluded): name -> mtime_ns."""
    if not results_dir.exists():
        return {}
    return {
        p.name: p.stat().st_mtime_ns for p in results_dir.iterdir() if not p.name.startswith(".")
    }


def kill_after_first_part(command: list[str], results_dir: Path, timeout_s: float = 120) -> None:
    """Run `command` (a job) and SIGKILL it as soon as it has published a result part.

    Raises:
        AssertionError: the child ended, or published nothing within `timeout_s`.
    """
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not published_parts(results_dir):
            assert child.poll() is None, child.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no part was written in time"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
