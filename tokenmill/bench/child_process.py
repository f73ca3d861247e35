"""One benchmark run in a process of its own, and how its failure is reported."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping


def run_child(
    command: list[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> str | None:
    """Run `command` to its end; None on success, else why it failed in one line (its
    stderr's last line, cut to 300 characters, or the timeout) - a report's note."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return (lines[-1] if lines else f"exit status {done.returncode}")[:300]
    return None
