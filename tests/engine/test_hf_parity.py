"""Our engine against HF transformers on the same random weights (fp32)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hf_models import (
    assert_logprobs_match,
    assert_matches,
    build_hf_model,
    hf_greedy,
    hf_prompt_logprobs,
    make_engine,
    run_all,
    save_char_tokenizer,
)

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.models import load_config
from tokenmill.engine.types.sampling_params import SamplingParams


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


def assert_llm_matches_transformers(hf, model_dir, prompts: list[list[int]]) -> None:
    """Through `LLM`: chunked prefill (16 tokens a step) and the prefix cache (block 4) -
    greedy tokens equal transformers', and prompt log-probs (top 5 and the prompt's own
    token) within fp32 rounding of its."""
    save_char_tokenizer(model_dir)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)[0]
        assert_matches(out, prompt, hf_prompt_logprobs(hf, prompt), 5)


@torch.no_grad()
def largest_change(hf, other, prompts: list[list[int]]) -> float:
    """The largest difference between two HF models' log-probs over the prompts."""
    return max(
        (hf_prompt_logprobs(hf, p) - hf_prompt_logprobs(other, p)).abs().max().item()
        for p in prompts
    )


def without_biases(hf):
    """A copy of the HF model with every bias zeroed."""
    bare = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in bare.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
    return bare


LLAMA_BIASES = {"attention_bias": {"attention_bias": True}, "mlp_bias": {"mlp_bias": True}}


@pytest.mark.parametrize("biases", LLAMA_BIASES.values(), ids=LLAMA_BIASES.keys())
def test_llama_biases_match_transformers(biases, tmp_path):
    """q/k/v/o biases (attention_bias) and gate/up/down biases (mlp_bias), as transformers'
    Llama has them: each changes the model, and ours computes what it computes."""
    hf = build_hf_model("llama", tmp_path, **biases)
    config = load_config(tmp_path)
    has_attention = "attention_bias" in biases
    assert (config.attention_bias, config.attention_output_bias) == (has_attention,) * 2
    assert config.mlp_bias == ("mlp_bias" in biases)
    prompts = mixed_prompts(256, seed=6)
    assert largest_change(hf, without_biases(hf), prompts[:3]) > 0.5
    engine = make_engine(tmp_path, max_num_batched_tokens=16)  # forces chunked prefill
    assert_logprobs_match(hf, engine, prompts[:5], 6)
    assert_llm_matches_transformers(hf, tmp_path, prompts)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_sliding_window_matches_transformers(kind, tmp_path):
    """use_sliding_window: the layers from max_window_layers on see the last 16 positions,
    the ones before it everything (transformers' rule); prompts of up to 77 tokens."""
    window = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    hf = build_hf_model(kind, tmp_path, **window)
    config = load_config(tmp_path)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert [config.layer_sliding_window(i) for i in range(2)] == [None, 16]
    prompts = mixed_prompts(256, seed=7)
    # The same weights without the window answer otherwise once a prompt outgrows it.
    full = build_hf_model(kind, tmp_path / "full", **{**window, "use_sliding_window": False})
    assert load_config(tmp_path / "full").sliding_window is None
    assert largest_change(hf, full, [p for p in prompts if len(p) > 40][:2]) > 0.5
    engine = make_engine(tmp_path, max_num_batched_tokens=16)  # forces chunked prefill
    assert_logprobs_match(hf, engine, prompts[3:], 4)
    assert_llm_matches_transformers(hf, tmp_path, prompts)
