"""Planning memory is bounded by the window, not the dataset: 10x the rows, ~the same peak.

Each measurement runs in a fresh subprocess: a warm-up plan first imports everything
planning imports lazily, then `tracemalloc` records the peak of Python (and numpy)
allocations while a whole input is planned, and Arrow's pool its own peak. Before
windowed planning the 100k-row peak was 5.5x the 10k-row one (every row's tokens,
ids and passthrough values were kept until planning ended).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq

WINDOW = 4096  # below both sizes, so both peaks are window-bound
MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import gc, json, sys, tracemalloc
    import pyarrow as pa
    from tokenmill.pipelines.job import plan_job
    from tokenmill.pipelines.spec import JobSpec

    model, src, output, window = sys.argv[1:5]

    def spec(out, **options):
        return JobSpec(src, out, model=model, id_column="id", plan_window_rows=int(window),
                       max_tokens=1, **options)

    plan_job(spec(output + "-warm", limit=10))
    gc.collect()
    tracemalloc.start()
    plan = plan_job(spec(output))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"rows": plan.num_rows, "shards": len(plan.shards), "peak": peak,
                      "arrow_peak": pa.default_memory_pool().max_memory()}))
    """
)


def _input(path, num_rows):
    table = pa.table(
        {
            "id": [f"id-{i}" for i in range(num_rows)],
            "prompt": [f"Summarise item {i % 97}: the quick fox {i}" for i in range(num_rows)],
        }
    )
    pq.write_table(table, path, row_group_size=8192)
    return str(path)


def _plan_peak(tmp_path, model_dir, num_rows) -> dict:
    src = _input(tmp_path / f"in-{num_rows}.parquet", num_rows)
    args = [str(model_dir), src, str(tmp_path / f"out-{num_rows}"), str(WINDOW)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["rows"] == num_rows
    return measured


def test_planning_peak_does_not_grow_with_the_dataset(tmp_path, tiny_model_dir):
    small = _plan_peak(tmp_path, tiny_model_dir, 10_000)
    large = _plan_peak(tmp_path, tiny_model_dir, 100_000)
    assert large["shards"] >= 100_000 // WINDOW  # shards never span windows
    assert large["peak"] < 1.5 * small["peak"], (small, large)
    assert large["peak"] < 24 * MIB, large
    assert large["arrow_peak"] < 1.5 * small["arrow_peak"] + MIB, (small, large)
