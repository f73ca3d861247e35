"""A job killed midway (SIGKILL, in a subprocess) resumes without losing or repeating rows."""

from __future__ import annotations

import json
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
from child_jobs import kill_after_first_part, published_parts

from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

NUM_ROWS = 40
ENGINE = {"kv_cache_memory": 8 << 20}

# The child runs the real job; a pause after each shard's generate() keeps it busy long
# enough for the parent to kill it between shards or in the middle of one.
CHILD = textwrap.dedent(
    """
    import sys, time
    from tokenmill.engine.api.llm import LLM
    from tokenmill.pipelines.job import run_job

    generate = LLM.generate

    def slow_generate(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        time.sleep(0.4)
        return outputs

    LLM.generate = slow_generate
    src, out, model = sys.argv[1:4]
    run_job(src, out, model=model, id_column="id", max_tokens=4, shard_tokens=120, dtype="float32",
            engine_options={"kv_cache_memory": 8 << 20})
    """
)


def _input(path):
    prompts = [
        ("Summarise the following text in one sentence: " if i % 2 else "")
        + f"item {i} " * (1 + i % 4)
        for i in range(NUM_ROWS)
    ]
    pq.write_table(pa.table({"id": [f"id-{i}" for i in range(NUM_ROWS)], "prompt": prompts}), path)
    return str(path)


def test_sigkill_midway_then_rerun(tmp_path, tiny_model_dir):
    src = _input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    kill_after_first_part(
        [sys.executable, str(script), src, str(out), str(tiny_model_dir)], out / "results"
    )
    before = published_parts(out / "results")
    assert not (out / "ledger.json").exists()  # it never finished

    ledger = run_job(
        src,
        str(out),
        model=str(tiny_model_dir),
        id_column="id",
        max_tokens=4,
        shard_tokens=120,
        dtype="float32",
        engine_options=ENGINE,
    )

    after = published_parts(out / "results")
    assert all(after[name] == mtime for name, mtime in before.items())  # not recomputed
    assert ledger.num_shards_run == ledger.num_shards - len(before) > 0
    results = read_results(str(out))
    ids = results["id"].to_pylist()
    assert sorted(ids) == sorted(f"id-{i}" for i in range(NUM_ROWS))  # one row per id
    assert results.num_rows == NUM_ROWS
    on_disk = json.loads((out / "ledger.json").read_text())
    for key in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        assert on_disk[key] == sum(results[key].to_pylist())
    assert on_disk["rows_ok"] + on_disk["rows_failed"] == NUM_ROWS
    # device time of the killed run's finished shards is still accounted for
    stats = [json.loads(p.read_text()) for p in (out / "shard_stats").glob("*.json")]
    assert ledger.device_seconds == sum(
        s["device_seconds"] for s in stats if f"{s['shard_id']}.parquet" in after
    )
