"""Batch jobs on the real engine, with a tiny random-weight Llama (CPU, seconds)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

ENGINE = {"kv_cache_memory": 8 << 20}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from tokenmill.engine.api.llm import LLM

    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", **ENGINE)


def test_messages_job_bad_rows_and_good_rows(tmp_path, tiny_llm):
    system = "You are a helpful assistant. Answer briefly and clearly. " * 3
    good = [{"role": "user", "content": f"What is {i} + {i}?"} for i in range(6)]
    messages = [json.dumps([m]) for m in good] + [
        None,
        "not json",
        json.dumps([{"role": "user"}]),
        json.dumps([{"role": "wizard", "content": "x"}]),
        json.dumps([{"role": "user", "content": "The quick brown fox " * 100}]),  # > 256 tokens
    ]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(messages))], "m": messages}), src)
    out = tmp_path / "out"
    ledger = run_job(
        str(src),
        str(out),
        llm=tiny_llm,
        messages_column="m",
        id_column="id",
        system=system,
        max_tokens=4,
        shard_tokens=200,
    )
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert len(rows) == 11
    for i in range(6):
        r = rows[f"q{i}"]
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert 0 < r["completion_tokens"] <= 4 and isinstance(r["output"], str)
    assert rows["q6"]["error"] == "messages are null"
    assert rows["q7"]["error"].startswith("messages are not valid JSON")
    assert rows["q8"]["error"] == "message 0 content is not a string"
    assert rows["q9"]["error"] == "message 0 has invalid role 'wizard'"
    assert "longer than the model's context of 256 tokens" in rows["q10"]["error"]
    assert (ledger.rows_ok, ledger.rows_failed) == (6, 5)
    # the shared system prompt spans several 16-token blocks: later rows hit the cache
    assert ledger.cached_tokens > 0 and ledger.prefix_cache_hit_rate > 0.3
    assert ledger.cached_tokens == sum(r["cached_tokens"] for r in rows.values())
    assert ledger.device == "cpu" and ledger.device_seconds > 0
    assert ledger.latency_p50_s is not None and ledger.latency_p50_s <= ledger.latency_p99_s


def test_run_job_loads_the_model_itself(tmp_path, tiny_model_dir):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Numbers: {i}"}) + "\n" for i in range(5)))
    ledger = run_job(
        str(src),
        str(tmp_path / "out"),
        model=str(tiny_model_dir),
        max_tokens=3,
        engine_options=ENGINE,
        dtype="float32",
    )
    assert ledger.rows_ok == 5 and ledger.completion_tokens == 15
    assert ledger.model == tiny_model_dir.name and len(ledger.weights_hash) == 64
