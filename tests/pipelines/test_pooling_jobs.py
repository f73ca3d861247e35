"""Pooling jobs (`task` embed, classify, rerank) on random-weight models: results equal
the engine's own `LLM.embed` / `classify` / `score`; the Parquet layout (fixed-size
float32 lists, polars Array); truncation and bad rows; the ledger; job options; the
notebook functions; a decoder's shared instruction prefix; resume after a kill."""

from __future__ import annotations

import json
import sys

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from child_jobs import kill_after_first_part, published_parts
from click.testing import CliRunner
from pooling_models import (
    build_decoder,
    build_encoder,
    build_sentence_encoder,
    write_sentence_transformers_files,
)
from tiny_model import build_tiny_model

import tokenmill
from tokenmill.cli import main
from tokenmill.engine.api.llm import LLM
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "search the web for a relevant passage",
    "a",
    "the cat is on the road in the city by the river and the sea",
    "red blue green",
    "what is the capital city",
]
LONG = " ".join(["the quick brown fox"] * 10)  # 42 tokens: over max_seq_length 16


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_sentence_encoder(tmp_path_factory.mktemp("encoder"), max_seq_length=16)


@pytest.fixture(scope="module")
def encoder(encoder_dir):
    return LLM(str(encoder_dir), dtype="float32")


def write_input(path, texts, **columns) -> str:
    data = {"id": [f"doc{i}" for i in range(len(texts))], "text": texts, **columns}
    pq.write_table(pa.table(data), path)
    return str(path)


def test_embed_job_results_equal_the_engine_and_read_as_fixed_size_lists(
    tmp_path, encoder, encoder_dir
):
    texts = [*TEXTS, None, "   ", LONG]
    src = write_input(tmp_path / "in.parquet", texts)
    ledger = run_job(
        src,
        str(tmp_path / "out"),
        task="embed",
        llm=encoder,
        prompt_column="text",
        id_column="id",
        shard_tokens=40,
        price_input=1.0,
    )
    results = read_results(str(tmp_path / "out")).sort_by("id")
    field = results.schema.field("embedding")
    assert field.type == pa.list_(pa.float32(), 64)  # FixedSizeList: polars Array, FLOAT[64]
    frame = pl.from_arrow(results)
    assert frame.schema["embedding"] == pl.Array(pl.Float32, 64)
    by_id = {r["id"]: r for r in results.to_pylist()}
    want = encoder.embed([t for t in texts if t and t.strip()])
    good = [f"doc{i}" for i, t in enumerate(texts) if t and t.strip()]
    for row_id, out in zip(good, want):
        row = by_id[row_id]
        assert row["finish_reason"] == "embed" and row["error"] is None
        np.testing.assert_allclose(row["embedding"], out.embedding, atol=1e-6)
        assert row["truncated"] == out.truncated
        assert row["prompt_tokens"] == len(out.prompt_token_ids) and row["completion_tokens"] == 0
    assert by_id["doc8"]["truncated"] is True and by_id["doc8"]["prompt_tokens"] == 16
    assert by_id["doc6"]["error"] == "prompt is null" and by_id["doc6"]["embedding"] is None
    assert by_id["doc7"]["error"] == "prompt is empty"
    assert ledger.task == "embed" and ledger.rows_ok == 7 and ledger.rows_failed == 2
    assert ledger.num_shards > 1
    assert ledger.completion_tokens == 0 and ledger.cached_tokens == 0
    assert ledger.prompt_tokens == sum(r["prompt_tokens"] for r in by_id.values())
    assert ledger.cost_total == pytest.approx(ledger.prompt_tokens / 1e6)
    assert ledger.throughput_rows_per_s == pytest.approx(7 / ledger.device_seconds)


def test_options_of_an_embed_job(tmp_path, encoder):
    src = write_input(tmp_path / "in.parquet", [*TEXTS, LONG])
    run_job(
        src,
        str(tmp_path / "out"),
        task="embed",
        llm=encoder,
        prompt_column="text",
        dimensions=8,
        embedding_dtype="float16",
        truncate="never",
    )
    results = read_results(str(tmp_path / "out")).sort_by("id")
    assert results.schema.field("embedding").type == pa.list_(pa.float16(), 8)
    row = results.to_pylist()[0]
    want = encoder.embed(TEXTS[0], dimensions=8)[0].embedding
    np.testing.assert_allclose(np.asarray(row["embedding"], np.float32), want, atol=1e-3)
    assert "max_seq_length of 16 (truncation is off)" in results["error"].to_pylist()[-1]


def test_bad_option_combinations_fail_before_compute(tmp_path, encoder, encoder_dir):
    src = write_input(tmp_path / "in.parquet", TEXTS)
    out = str(tmp_path / "out")
    cases = [
        (dict(task="embed", max_tokens=5), "embed job generates nothing"),
        (dict(task="generate", dimensions=8), "dimensions: options of embed"),
        (dict(task="classify", dimensions=8), "not an option of a classify job"),
        (dict(task="rerank"), "needs query_column"),
        (dict(task="embed", raw=False), "pools text as it is"),
        (dict(task="embed", dimensions=65, llm=encoder), "more than the model's 64"),
        (dict(task="embed", prompt_name="query", llm=encoder), "no prompt named 'query'"),
        (dict(task="classify", llm=encoder), "serves embed, not classify"),
    ]
    for options, message in cases:
        options.setdefault("model", str(encoder_dir))
        with pytest.raises(ValueError, match=message):
            run_job(src, out, prompt_column="text", **options)
    tiny = build_tiny_model(tmp_path / "tiny")
    with pytest.raises(ValueError, match="serves generate, not embed"):
        run_job(src, out, prompt_column="text", task="embed", model=str(tiny))


def test_classify_and_rerank_jobs(tmp_path):
    head = tmp_path / "head"
    build_encoder("bert", head, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    llm = LLM(str(head), dtype="float32")
    src = write_input(tmp_path / "in.parquet", TEXTS, query=["what is it"] * len(TEXTS))
    run_job(
        src, str(tmp_path / "c"), task="classify", llm=llm, prompt_column="text", id_column="id"
    )
    rows = read_results(str(tmp_path / "c")).sort_by("id").to_pylist()
    for row, want in zip(rows, llm.classify(TEXTS)):
        assert row["label"] == want.label and row["finish_reason"] == "classify"
        np.testing.assert_allclose(row["probs"], want.probs, atol=1e-6)

    cross = tmp_path / "cross"
    build_encoder("bert", cross, num_labels=1)
    reranker = LLM(str(cross), dtype="float32")
    run_job(
        src,
        str(tmp_path / "r"),
        task="rerank",
        llm=reranker,
        prompt_column="text",
        query_column="query",
        id_column="id",
    )
    rows = read_results(str(tmp_path / "r")).sort_by("id").to_pylist()
    for row, want in zip(rows, reranker.score("what is it", TEXTS)):
        assert row["score"] == pytest.approx(want.score, abs=1e-6)
        assert row["prompt_tokens"] == len(want.prompt_token_ids)


def test_notebook_functions_return_frames_in_input_order(encoder):
    frame = pl.DataFrame({"text": TEXTS[::-1], "n": list(range(len(TEXTS)))})
    embedded = tokenmill.embed(frame, column="text", llm=encoder)
    assert embedded.schema["embedding"] == pl.Array(pl.Float32, 64)
    assert embedded["n"].to_list() == frame["n"].to_list()  # input order, input columns kept
    want = [o.embedding for o in encoder.embed(TEXTS[::-1])]
    np.testing.assert_allclose(embedded["embedding"].to_numpy(), np.array(want), atol=1e-6)
    assert set(embedded.columns) >= {"id", "embedding", "truncated", "error", "text", "n"}
    with pytest.raises(ValueError, match="not classify"):
        tokenmill.classify(frame, column="text", llm=encoder)


def test_a_decoder_embedding_job_shares_its_instruction_prefix(tmp_path):
    model = tmp_path / "qwen3"
    build_decoder("qwen3", model)
    instruction = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
    write_sentence_transformers_files(
        model, pooling_mode="lasttoken", normalize=True, prompts={"query": instruction}
    )
    llm = LLM(str(model), dtype="float32", block_size=4)
    src = write_input(tmp_path / "in.parquet", TEXTS)
    ledger = run_job(
        src, str(tmp_path / "out"), task="embed", llm=llm, prompt_column="text", prompt_name="query"
    )
    rows = read_results(str(tmp_path / "out")).sort_by("id").to_pylist()
    for row, want in zip(rows, llm.embed(TEXTS, prompt_name="query")):
        np.testing.assert_allclose(row["embedding"], want.embedding, atol=1e-6)
    assert ledger.cached_tokens > 0  # the instruction was computed once per block run
    assert ledger.prefix_cache_hit_rate > 0.3


def test_the_cli_runs_an_embed_job_and_resumes_after_a_kill(tmp_path, encoder_dir):
    texts = [f"{t} {i}" for i in range(40) for t in TEXTS[:1]]
    src = write_input(tmp_path / "in.parquet", texts)
    out = tmp_path / "out"
    args = ["run", src, str(out), "--task", "embed", "--model", str(encoder_dir)]
    args += ["--prompt-column", "text", "--id-column", "id", "--shard-tokens", "30"]
    args += ["--dtype", "float32"]
    child = [sys.executable, "-c", "from tokenmill.cli import main; main()", *args, "--no-progress"]
    kill_after_first_part(child, out / "results")
    before = published_parts(out / "results")
    result = CliRunner().invoke(main, [*args, "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    ledger = json.loads(result.output)  # --json: the ledger and nothing else
    after = published_parts(out / "results")
    assert all(after[name] == mtime for name, mtime in before.items())  # not recomputed
    assert ledger["num_shards_run"] == ledger["num_shards"] - len(before)
    results = read_results(str(out))
    ids = results["id"].to_pylist()
    assert sorted(ids) == sorted(f"doc{i}" for i in range(40)) and len(set(ids)) == 40
    assert ledger["rows_ok"] == 40 and ledger["task"] == "embed"


def test_notebook_classify_and_rerank(tmp_path):
    head = tmp_path / "head"
    build_encoder("bert", head, num_labels=2, id2label={0: "no", 1: "yes"})
    classifier = LLM(str(head), dtype="float32")
    frame = pl.DataFrame({"text": TEXTS, "query": ["what is it"] * len(TEXTS)})
    classified = tokenmill.classify(frame, column="text", llm=classifier)
    want = classifier.classify(TEXTS)
    assert classified["label"].to_list() == [o.label for o in want]
    np.testing.assert_allclose(
        np.stack(classified["probs"].to_list()), [o.probs for o in want], atol=1e-6
    )

    cross = tmp_path / "cross"
    build_encoder("bert", cross, num_labels=1)
    reranker = LLM(str(cross), dtype="float32")
    ranked = tokenmill.rerank(frame, column="text", query_column="query", llm=reranker)
    scores = [o.score for o in reranker.score("what is it", TEXTS)]
    np.testing.assert_allclose(ranked["score"].to_numpy(), scores, atol=1e-6)
    assert ranked["finish_reason"].to_list() == ["rerank"] * len(TEXTS)
