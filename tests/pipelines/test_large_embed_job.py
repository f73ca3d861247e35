"""A 100,000-row embedding job end to end on a tiny random BERT embedding model: its memory
is a shard's, not the dataset's, as a generation job's is (test_large_job.py).

Each job runs in a fresh subprocess that reports its peak RSS; the 100k-row job's peak
must stay close to a 10k-row job's. The results are checked here, in the parent.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from child_jobs import run_job_in_child
from pooling_models import build_sentence_encoder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_sentence_encoder(tmp_path_factory.mktemp("encoder"))


def _run(tmp_path, model_dir, num_rows) -> dict:
    words = ["the quick brown fox", "search the web", "a red car on the road", "data model"]
    prompts = [f"{words[i % 4]} {i % 97} {words[(i // 4) % 4]}" for i in range(num_rows)]
    options = {
        "task": "embed",
        "dtype": "float32",
        "engine_options": {"max_num_batched_tokens": 8192},
    }
    report, results, out = run_job_in_child(tmp_path, model_dir, prompts, options)
    ledger = report["ledger"]
    assert results.num_rows == num_rows == ledger["rows_ok"]
    assert pc.count_distinct(results["id"]).as_py() == num_rows
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    assert ledger["prompt_tokens"] == pc.sum(results["prompt_tokens"]).as_py()
    assert not (out / "_plan").exists()
    return report


def test_100k_rows_in_about_the_memory_of_10k(tmp_path, encoder_dir):
    small = _run(tmp_path, encoder_dir, 10_000)
    large = _run(tmp_path, encoder_dir, 100_000)
    assert large["ledger"]["num_shards"] >= 10 * small["ledger"]["num_shards"] // 2
    assert large["maxrss"] < 1.25 * small["maxrss"], (small["maxrss"], large["maxrss"])
