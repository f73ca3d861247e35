"""Every rope scaling, and Phi-3's partial rotary with LongRoPE, against transformers on
the same random weights (fp32): greedy tokens and log-probs as one transformers forward
over the whole sequence computes them (`dynamic` and `longrope` choose their
frequencies from its length), through `LLM` with chunked prefill and the prefix cache,
and through a job."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_models import (
    assert_matches_full_forward,
    build_hf_model,
    hf_full_logprobs,
    run_token_prompts_as_job,
    save_char_tokenizer,
)

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import load_config, parse_config
from tokenmill.engine.types.sampling_params import SamplingParams

HEAD_DIM = 16  # SMALL's 64 hidden / 4 heads
# The original context every scaling here extends: prompts and completions cross it.
ORIGINAL = 32


def factors(n: int, start: float, step: float) -> list[float]:
    return [start + step * i for i in range(n)]


# kind -> (build_hf_model arguments).
CASES = {
    "yarn": dict(
        kind="llama",
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "yarn-betas": dict(
        kind="qwen2",
        max_position_embeddings=128,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
        },
    ),
    "dynamic": dict(
        kind="llama",
        max_position_embeddings=ORIGINAL,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    ),
    "longrope": dict(
        kind="llama",
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": factors(HEAD_DIM // 2, 1.0, 0.05),
            "long_factor": factors(HEAD_DIM // 2, 1.5, 0.9),
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    # Phi-4-mini's shape: three quarters of each head rotate, LongRoPE, tied embeddings;
    # and Phi-3-mini-4k's window on every layer.
    "phi3": dict(
        kind="phi3",
        max_position_embeddings=512,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        sliding_window=40,
        rope_scaling={
            "type": "longrope",
            "short_factor": factors(6, 1.0, 0.1),
            "long_factor": factors(6, 2.0, 1.5),
        },
    ),
}


def case_model(name: str, tmp_path):
    args = dict(CASES[name])
    hf = build_hf_model(args.pop("kind"), tmp_path, **args)
    save_char_tokenizer(tmp_path)
    return hf


def crossing_prompts(seed: int) -> list[list[int]]:
    """Prompts around the original context: some stay short with their completion, some
    cross it only by generating (28 + 8), some start past it; two share a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (4, 8, 40)]
    prompts += [[rng.randrange(256) for _ in range(n)] for n in (3, 24, 28, 61, 90)]
    return prompts


@pytest.mark.parametrize("name", CASES)
def test_rope_scaling_matches_one_transformers_forward(name, tmp_path):
    hf = case_model(name, tmp_path)
    config = load_config(tmp_path)
    assert config.rope.kind == ("longrope" if name == "phi3" else name.split("-")[0])
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,  # chunked prefill
        enable_prefix_caching=True,
    )
    prompts = crossing_prompts(seed=len(name))
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert_matches_full_forward(out, prompt, hf, 5)
    # Again without prompt log-probs, so that the cached prefixes are served.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert_matches_full_forward_generated(out, prompt, hf)
    assert llm.engine.stats.cached_prompt_tokens > 0


def test_the_scalings_change_the_model(tmp_path):
    """Each case answers otherwise without its scaling, on the long sequences: the
    comparison above would catch a scaling left out."""
    for name in CASES:
        hf = case_model(name, tmp_path / name)
        plain = dict(CASES[name])
        kind = plain.pop("kind")
        plain["rope_scaling"] = None
        if kind == "phi3":
            plain["partial_rotary_factor"] = 0.75
        bare = build_hf_model(kind, tmp_path / f"{name}-plain", **plain)
        ids = crossing_prompts(seed=1)[-1]
        change = (hf_full_logprobs(hf, ids) - hf_full_logprobs(bare, ids)).abs().max()
        assert change > 0.1, name


def test_length_dependent_frequencies_never_share_cached_blocks(tmp_path):
    """One prompt twice: once short enough to keep LongRoPE's short factors, once with a
    budget that crosses the original context. The second must compute its own keys (the
    variant keys the prefix cache), and both match transformers."""
    hf = case_model("longrope", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, enable_prefix_caching=True)
    prompt = crossing_prompts(seed=3)[4]  # 24 tokens
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    first = llm.generate([prompt], short)[0]
    assert_matches_full_forward_generated(first, prompt, hf)
    again = llm.generate([prompt], short)[0]
    assert again.cached_tokens == 20  # the same variant: served from the cache
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    crossing = llm.generate([prompt], long)[0]
    assert crossing.cached_tokens == 0
    assert_matches_full_forward_generated(crossing, prompt, hf)


def assert_matches_full_forward_generated(out, prompt, hf) -> None:
    generated = out.outputs[0].token_ids
    reference = hf_full_logprobs(hf, prompt + generated)
    for step, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        want = reference[len(prompt) - 1 + step]
        assert token == int(want.argmax())
        ours = torch.tensor(list(entry.values()))
        torch.testing.assert_close(ours, want[list(entry.keys())], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["dynamic", "phi3"])
def test_rope_scaling_matches_transformers_through_a_job(name, tmp_path):
    """The same through `run_job`: each row's text is its tokens (one character each)."""
    model_dir = tmp_path / "model"
    hf = case_model(name, model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = crossing_prompts(seed=7)
    results = run_token_prompts_as_job(model_dir, prompts, tmp_path / "out")
    for prompt, row in zip(prompts, results):
        generated = tokenizer.encode(row["output"])
        assert len(generated) == 8 and row["finish_reason"] == "length"
        reference = hf_full_logprobs(hf, prompt + generated)
        for step, (token, entry) in enumerate(zip(generated, row["logprobs"])):
            want = reference[len(prompt) - 1 + step]
            assert token == int(want.argmax())
            assert abs(entry["logprob"] - float(want[token])) < 2e-4


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, None),
        ({"rope_type": "dynamic", "factor": 2.0}, None),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}, None),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4}, "needs long_factor"),
        ({"rope_type": "dynamc", "factor": 2.0}, "'dynamc' is not supported \\(nearest: 'dynamic'"),
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "'ntk-by-parts' is not supported"),
        ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 2.0}, "'low_freq_factor'"),
    ],
)
def test_rope_types_parse_or_are_refused_by_name(rope, message):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rope_scaling": rope,
    }
    if message is not None:
        with pytest.raises(ValueError, match=message):
            parse_config(raw)
        return
    config = parse_config(raw)
    assert config.rope_scaling["rope_type"] == rope["rope_type"]


def test_contexts_and_variants_follow_the_scaling():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    dynamic = parse_config({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert dynamic.max_context == 256
    assert [dynamic.rope.variant_for_length(n) for n in (10, 64, 65, 200)] == [0, 0, 65, 200]
    longrope = parse_config(
        {
            **base,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [3.0] * 4,
                "original_max_position_embeddings": 16,
            },
        }
    )
    assert longrope.max_context == 64
    assert [longrope.rope.variant_for_length(n) for n in (16, 17)] == [0, 1]
    # transformers' default attention factor: sqrt(1 + ln(64 / 16) / ln(16)).
    assert longrope.rope.attention_factor == pytest.approx((1 + 2 / 4) ** 0.5)
    yarn = parse_config(
        {
            **base,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert yarn.max_context == 128 and yarn.rope.variant_for_length(10_000) == 0


def test_phi3_config_as_transformers_reads_it(tmp_path):
    """The old "su" name is LongRoPE, and the original context is the top-level field."""
    import transformers

    raw = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2},
    }
    config = parse_config(raw)
    reference = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert config.rope_scaling["rope_type"] == reference.rope_parameters["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 32
    assert config.rope.dim == 4
    (tmp_path / "config.json").write_text(
        json.dumps({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    )
    with pytest.raises(ValueError, match="Phi3ForCausalLM: rope_scaling type 'linear'"):
        load_config(tmp_path)
