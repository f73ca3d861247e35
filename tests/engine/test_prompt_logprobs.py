"""Prompt log-probabilities against HF transformers on the same random weights (fp32)."""

from __future__ import annotations

import random

import pytest
from hf_models import (
    assert_matches,
    build_hf_model,
    hf_greedy,
    hf_prompt_logprobs,
    make_engine,
    run_all,
)
from test_hf_parity import mixed_prompts

from tokenmill.engine.types.sampling_params import SamplingParams

VOCAB = 256


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompt_logprobs_match_transformers(kind, prefix_caching, tmp_path):
    hf = build_hf_model(kind, tmp_path)
    # 16 tokens a step: the 60- and 77-token prompts arrive over several chunks.
    engine = make_engine(tmp_path, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    prompts = mixed_prompts(VOCAB, seed=4)
    ks = [0, 1, 5, 0, 3, 2, 0, 4, 1]
    params = [
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k) for k in ks
    ]
    outputs = run_all(engine, prompts, params)
    for prompt, out, k in zip(prompts, outputs, ks):
        assert_matches(out, prompt, hf_prompt_logprobs(hf, prompt), k)


def test_cached_prefix_is_scored_not_skipped(tmp_path):
    """A prompt whose prefix another request already put in the cache still gets every
    token's logprob; a request without prompt logprobs keeps using the cache."""
    hf = build_hf_model("llama", tmp_path)
    engine = make_engine(tmp_path, enable_prefix_caching=True)
    prefix = mixed_prompts(VOCAB, seed=5)[0][:20]
    plain = SamplingParams(temperature=0, max_tokens=1)
    run_all(engine, [prefix + [7, 8, 9]], plain)  # fills the cache with the prefix
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = prefix + [1, 2, 3, 4]
    out = run_all(engine, [prompt], scored)[0]
    assert out.cached_tokens == 0  # computed again, so it could be scored
    assert_matches(out, prompt, hf_prompt_logprobs(hf, prompt), 0)
    again = run_all(engine, [prefix + [5, 6]], plain)[0]
    assert again.cached_tokens == 20  # 5 blocks of 4


def test_preempted_request_keeps_its_entries(tmp_path):
    """Preemption recomputes a sequence; its prompt entries are neither lost nor doubled."""
    hf = build_hf_model("llama", tmp_path)
    # 16 blocks of 4 tokens = 64 tokens of cache for ~220 tokens of sequences.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # k+v, layers, kv heads, head_dim, block, fp32
    engine = make_engine(tmp_path, kv_cache_memory=16 * block_bytes, max_num_seqs=8)
    rng = random.Random(6)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 21, 30, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    outputs = run_all(engine, prompts, params)
    assert engine.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert_matches(out, prompt, hf_prompt_logprobs(hf, prompt), 2)


def test_only_the_first_of_n_completions_scores_and_others_share_the_cache(tmp_path):
    build_hf_model("llama", tmp_path)
    engine = make_engine(tmp_path, enable_prefix_caching=True)
    prompt = mixed_prompts(VOCAB, seed=7)[3]
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1)
    out = run_all(engine, [prompt], params)[0]
    assert len(out.prompt_logprobs) == len(prompt)


def test_negative_prompt_logprobs_is_rejected():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("prefix_caching, overlap", [(False, False), (True, False), (True, True)])
def test_prompt_only_requests_score_and_sample_nothing(prefix_caching, overlap, tmp_path):
    """max_tokens=0: the prompt is scored as with max_tokens=1, no token is sampled or
    counted, and generating requests in the same batches are unaffected."""
    hf = build_hf_model("llama", tmp_path)
    engine = make_engine(
        tmp_path,
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
        overlap_steps=overlap,
    )
    prompts = mixed_prompts(VOCAB, seed=8)
    scored = SamplingParams(max_tokens=0, prompt_logprobs=0)
    generating = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params = [scored if i % 2 == 0 else generating for i in range(len(prompts))]
    outputs = run_all(engine, prompts, params)
    num_generating = sum(1 for p in params if p is generating)
    assert engine.stats.generated_tokens == 3 * num_generating
    for prompt, out, p in zip(prompts, outputs, params):
        if p is generating:
            assert out.prompt_logprobs is None
            assert out.token_ids == hf_greedy(hf, prompt, 3)[0]
            continue
        assert out.error is None and out.prompt_tokens == len(prompt)
        assert out.completion_tokens == 0 and out.token_ids == [] and out.text == ""
        assert out.metrics.first_token_time is None and out.metrics.latency is not None
        assert_matches(out, prompt, hf_prompt_logprobs(hf, prompt), 0)


def test_a_prompt_only_request_may_fill_the_whole_context(tmp_path):
    hf = build_hf_model("llama", tmp_path)
    engine = make_engine(tmp_path, max_model_len=40)
    prompt = mixed_prompts(VOCAB, seed=9)[-1][:40]
    generating, scored = run_all(
        engine,
        [prompt, prompt],
        [
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            SamplingParams(max_tokens=0, prompt_logprobs=0),
        ],
    )
    assert generating.error == (
        "prompt has 40 tokens; the model's context is 40 tokens, leaving no room to generate"
    )
    assert scored.error is None
    assert_matches(scored, prompt, hf_prompt_logprobs(hf, prompt), 0)
    too_long = run_all(engine, [prompt + [1]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert too_long.error == "prompt has 41 tokens; the model's context is 40 tokens"


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=0, prompt_logprobs=0, n=2)])
def test_max_tokens_zero_is_for_scoring_one_prompt(kwargs):
    with pytest.raises(ValueError, match="max_tokens=0 generates nothing: it scores one prompt"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)
