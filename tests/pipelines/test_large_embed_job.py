"""A 100,000-row embedding job end to end on a tiny random BERT embedding model: its memory
is a shard's, not the dataset's, as a generation job's is (test_large_job.py).

Each job runs in a fresh subprocess that reports its peak RSS; the 100k-row job's peak
must stay close to a 10k-row job's. The results are checked here, in the parent.
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
from pooling_models import build_encoder, write_sentence_transformers_files

from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.slow

MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from tokenmill.pipelines.job import run_job

    src, out, model = sys.argv[1:4]
    ledger = run_job(src, out, model=model, id_column="id", task="embed", dtype="float32",
                     engine_options={"max_num_batched_tokens": 8192})
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"ledger": ledger.to_dict(), "maxrss": maxrss}))
    """
)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("encoder")
    build_encoder("bert", path)
    write_sentence_transformers_files(path, normalize=True)
    return path


def _run(tmp_path, model_dir, num_rows) -> dict:
    src = tmp_path / f"in-{num_rows}.parquet"
    words = ["the quick brown fox", "search the web", "a red car on the road", "data model"]
    table = pa.table(
        {
            "id": [f"id-{i}" for i in range(num_rows)],
            "prompt": [f"{words[i % 4]} {i % 97} {words[(i // 4) % 4]}" for i in range(num_rows)],
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
