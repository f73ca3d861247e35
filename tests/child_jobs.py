"""Jobs run in a child process: killed midway (SIGKILL), for the resume tests; or run to
the end reporting their peak RSS (`ru_maxrss`: model, engine, imports and the job
itself), for tests that compare a large job's memory with a small one's - the results
are read back in the parent, whose memory is not measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.pipelines.output import read_results


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


MIB = 1 << 20

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from tokenmill.pipelines.job import run_job

    src, out, model, options = sys.argv[1:5]
    ledger = run_job(src, out, model=model, id_column="id", **json.loads(options))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"ledger": ledger.to_dict(), "maxrss": maxrss}))
    """
)


def run_job_in_child(
    tmp_path: Path, model_dir: Path, prompts: list[str], options: dict
) -> tuple[dict, pa.Table, Path]:
    """Run a job over `prompts` (ids "id-0", "id-1", ...) with `options` in a fresh process.

    Returns:
        Its report ({"ledger": ..., "maxrss": bytes, "wall_s": ...}), its results, and its
        output directory.
    """
    num_rows = len(prompts)
    src = tmp_path / f"in-{num_rows}.parquet"
    table = pa.table({"id": [f"id-{i}" for i in range(num_rows)], "prompt": prompts})
    pq.write_table(table, src, row_group_size=8192)
    out = tmp_path / f"out-{num_rows}"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), str(model_dir), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.perf_counter() - started
    print(f"{num_rows} rows: {report['wall_s']:.1f} s, peak RSS {report['maxrss'] / MIB:.0f} MiB")
    return report, read_results(str(out)), out
