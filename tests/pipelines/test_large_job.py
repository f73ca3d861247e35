"""A 100,000-row job end to end on the tiny model: its memory is the batch's, not the dataset's.

Each job runs in a fresh subprocess that reports its peak RSS (`ru_maxrss`: model,
engine, imports and the job itself); the 100k-row job's peak must stay close to a
10k-row job's. The results are checked here, in the parent, whose memory is not measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.slow

MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from tokenmill.pipelines.job import run_job

    src, out, model = sys.argv[1:4]
    ledger = run_job(src, out, model=model, id_column="id", max_tokens=1, dtype="float32",
                     engine_options={"kv_cache_memory": 16 << 20, "max_num_seqs": 1024,
                                     "max_num_batched_tokens": 16384})
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"ledger": ledger.to_dict(), "maxrss": maxrss}))
    """
)


def _run(tmp_path, model_dir, num_rows) -> dict:
    src = tmp_path / f"in-{num_rows}.parquet"
    table = pa.table(
        {
            "id": [f"id-{i}" for i in range(num_rows)],
            "prompt": [f"Summarise item {i % 97}: the quick fox {i}" for i in range(num_rows)],
        }
    )
    pq.write_table(table, src, row_group_size=8192)
    out = tmp_path / f"out-{num_rows}"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.perf_counter() - started
    print(f"{num_rows} rows: {report['wall_s']:.1f} s, peak RSS {report['maxrss'] / MIB:.0f} MiB")

    results = read_results(str(out))
    ledger = report["ledger"]
    assert results.num_rows == num_rows
    assert pc.count_distinct(results["id"]).as_py() == num_rows
    assert ledger["rows_ok"] + ledger["rows_failed"] == num_rows
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        assert ledger[name] == pc.sum(results[name]).as_py()
    assert not (out / "_plan").exists()
    return report


def test_100k_rows_in_about_the_memory_of_10k(tmp_path, tiny_model_dir):
    small = _run(tmp_path, tiny_model_dir, 10_000)
    large = _run(tmp_path, tiny_model_dir, 100_000)
    assert large["ledger"]["num_shards"] >= 10 * small["ledger"]["num_shards"] // 2
    assert large["maxrss"] < 1.25 * small["maxrss"], (small["maxrss"], large["maxrss"])
