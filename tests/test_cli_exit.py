"""The console script leaves without the interpreter's teardown, and loses nothing by it:
exit statuses, buffered output and atexit handlers are what a normal exit gives."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import atexit, sys
atexit.register(lambda: print("atexit ran", file=sys.stderr))
sys.argv = ["tokenmill", *sys.argv[1:]]
from tokenmill.cli import entry_point
entry_point()
print("not reached")
"""


def _tokenmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, timeout=120
    )


def test_success_flushes_output_and_runs_atexit_handlers():
    done = _tokenmill("models", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: tokenmill models" in done.stdout  # buffered (a pipe), then flushed
    assert "not reached" not in done.stdout
    assert "atexit ran" in done.stderr


def test_usage_errors_and_failures_keep_their_status():
    usage = _tokenmill("generate")  # PROMPTS missing
    assert usage.returncode == 2 and "Missing argument" in usage.stderr
    failed = _tokenmill("run", "/no/such/file.jsonl", "/tmp/never-written")
    assert failed.returncode == 1 and "Error" in failed.stderr
    assert "atexit ran" in failed.stderr
