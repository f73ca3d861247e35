"""Overlapped steps (the CUDA default) against plain steps, on the CPU: launching step N
before resolving step N-1's tokens must not change a single output - tokens, text, finish
reasons, logprobs, cached-token counts - through EOS and stop strings one step late,
max_tokens, min_tokens, seeds, n > 1, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
from hf_models import build_hf_model, make_engine, run_all, save_char_tokenizer

from tokenmill.engine.types.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", path, eos_token_id=7)
    save_char_tokenizer(path)
    return path


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _summary(outputs) -> list:
    return [
        (
            o.prompt_tokens,
            o.cached_tokens,
            o.completion_tokens,
            o.error,
            [(c.token_ids, c.text, c.finish_reason) for c in o.outputs],
        )
        for o in outputs
    ]


def _assert_same(got, expected) -> None:
    """Equal outputs; logprobs equal to 1e-5. Overlapping changes which rows share a step,
    and F.linear (MKL: taken where oneDNN does not pack, or with TOKENMILL_PACKED_LINEAR=0)
    rounds the last bits by batch shape, where oneDNN's packed products do not."""
    assert _summary(got) == _summary(expected)
    for ours, theirs in zip(got, expected):
        for a, b in zip(ours.outputs, theirs.outputs):
            assert (a.logprobs is None) == (b.logprobs is None)
            for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
                assert step_a.keys() == step_b.keys()
                assert list(step_a.values()) == pytest.approx(list(step_b.values()), abs=1e-5)


def _both(model_dir, prompts, params, **config):
    plain = make_engine(model_dir, overlap_steps=False, **config)
    overlapped = make_engine(model_dir, overlap_steps=True, **config)
    filled = []
    step_tokens = overlapped.runner.step_tokens

    def recording(out):
        step = step_tokens(out)
        filled.append(bool(step.placeholder_rows))
        return step

    overlapped.runner.step_tokens = recording
    expected, got = run_all(plain, prompts, params), run_all(overlapped, prompts, params)
    assert any(filled), "no step read its predecessor's tokens on the device"
    return expected, got, plain, overlapped


def test_stops_found_a_step_late_end_where_plain_steps_end(model_dir):
    """Stop tokens and strings taken from each prompt's own free-running output, so that
    every kind of stop really fires (the random model never says EOS by itself)."""
    prompts = [_tokens(n, seed=n) for n in (3, 9, 14, 30, 5, 21, 12)]
    free = run_all(
        make_engine(model_dir),
        prompts,
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=30, ignore_eos=True)
    free_sampled = run_all(make_engine(model_dir), prompts[6:], seeded)[0]
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[0].token_ids[6]]),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=30, stop=[free[2].text[4]], logprobs=2),
        SamplingParams(
            temperature=0, max_tokens=30, min_tokens=8, stop_token_ids=[free[3].token_ids[2]]
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            stop=[free[5].text[3:5]],
            include_stop_str_in_output=True,
        ),
        SamplingParams(
            temperature=0.9,
            top_k=40,
            seed=3,
            max_tokens=30,
            stop_token_ids=[free_sampled.token_ids[9]],
            logprobs=0,
        ),
    ]
    expected, got, plain, overlapped = _both(model_dir, prompts, params)
    _assert_same(got, expected)
    assert overlapped.stats.generated_tokens == plain.stats.generated_tokens
    reasons = [o.finish_reason for o in expected]
    assert reasons.count("stop") >= 4, reasons
    assert len(expected[0].token_ids) <= 7 and len(expected[6].token_ids) <= 10


def test_sampling_controls_seeds_and_n(model_dir):
    prompts = [_tokens(n, seed=100 + n) for n in (4, 11, 19)]
    params = [
        SamplingParams(temperature=0.9, seed=3, max_tokens=30),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=5, n=3, max_tokens=15),
        SamplingParams(temperature=0.7, min_p=0.05, seed=9, max_tokens=18, logprobs=0),
    ]
    expected, got, _, _ = _both(model_dir, prompts, params)
    _assert_same(got, expected)


def test_prefix_cache_and_preemption(model_dir):
    shared = _tokens(24, seed=1)
    prompts = [shared + _tokens(n, seed=200 + n) for n in (1, 6, 13, 2, 9, 17)]
    params = SamplingParams(temperature=0, max_tokens=24)
    # 24 blocks of 4 tokens for ~300 tokens of sequences: preemption by recompute.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4
    expected, got, plain, overlapped = _both(
        model_dir, prompts, params, kv_cache_memory=24 * block_bytes, max_num_seqs=8
    )
    assert plain.stats.num_preemptions > 0 and overlapped.stats.num_preemptions > 0
    _assert_same(got, expected)
    assert overlapped.stats.cached_prompt_tokens > 0
