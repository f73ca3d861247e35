"""Our engine against HF transformers on the same random weights (fp32)."""

from __future__ import annotations

import random

import pytest
from hf_models import (
    assert_logprobs_match,
    build_hf_model,
    hf_greedy,
    make_engine,
    run_all,
)

from tokenmill.engine.models import load_config
from tokenmill.engine.sampling_params import SamplingParams


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(23)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 5, 17, 40)]
    prompts += [[rng.randrange(vocab) for _ in range(n)] for n in (1, 3, 9, 60, 77)]
    return prompts


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logprobs_match_transformers(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path)
    engine = make_engine(tmp_path, max_num_batched_tokens=16)  # forces chunked prefill
    assert_logprobs_match(hf, engine, mixed_prompts(256, seed=1)[:5], 6)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_with_prefix_cache_matches_transformers(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path)
    engine = make_engine(tmp_path, max_num_batched_tokens=48, enable_prefix_caching=True)
    prompts = mixed_prompts(256, seed=2)
    outputs = run_all(
        engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
    assert engine.stats.cached_prompt_tokens > 0  # the shared prefix was served from cache


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = build_hf_model("llama", tmp_path, rope_scaling=scaling, rope_theta=500000.0)
    engine = make_engine(tmp_path)
    prompt = mixed_prompts(256, seed=3)[8]
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)[0]


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Every Mistral layer sees the last 16 positions; prompts run to 100 tokens, in chunks
    of 16, with prefix-cache hits - and the context is no longer capped to the window."""
    hf = build_hf_model("mistral", tmp_path, sliding_window=16)
    assert load_config(tmp_path).max_context == 512
    engine = make_engine(tmp_path, max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = mixed_prompts(256, seed=5)
    outputs = run_all(
        engine, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)[0]
    assert engine.stats.cached_prompt_tokens > 0
