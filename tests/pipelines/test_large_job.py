"""A 100,000-row job end to end on the tiny model: its memory is the batch's, not the dataset's.

Each job runs in a fresh subprocess that reports its peak RSS (`ru_maxrss`: model,
engine, imports and the job itself); the 100k-row job's peak must stay close to a
10k-row job's. The results are checked here, in the parent, whose memory is not measured.
"""

from __future__ import annotations

import pyarrow.compute as pc
import pytest
from child_jobs import run_job_in_child

pytestmark = pytest.mark.slow


def _run(tmp_path, model_dir, num_rows) -> dict:
    prompts = [f"Summarise item {i % 97}: the quick fox {i}" for i in range(num_rows)]
    options = {
        "max_tokens": 1,
        "dtype": "float32",
        "engine_options": {
            "kv_cache_memory": 16 << 20,
            "max_num_seqs": 1024,
            "max_num_batched_tokens": 16384,
        },
    }
    report, results, out = run_job_in_child(tmp_path, model_dir, prompts, options)
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
