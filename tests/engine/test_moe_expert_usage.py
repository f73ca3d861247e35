"""The experts each step's MoE layers ran, as the engine counts them (EngineStats
.moe_experts_used, models/moe.py ExpertUsage), against transformers' router on the same
random weights: per step, each sparse layer's distinct top-k experts over the step's
rows, summed over layers."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import build_hf_model, make_engine, reset_rotary, save_char_tokenizer

from tokenmill.engine.models.moe import ExpertUsage
from tokenmill.engine.types.sampling_params import SamplingParams

ROUTER_TIE = 1e-4  # as test_moe_models: closer k-th and (k+1)-th logits choose either way


@torch.no_grad()
def hf_top_k(hf, token_ids: list[int]) -> list[torch.Tensor]:
    """Per sparse layer, [len, top_k] the experts transformers' router picks per position;
    asserts no position is a router tie (the fixture's prompts are chosen free of them)."""
    reset_rotary(hf)
    out = hf(torch.tensor([token_ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    picks = []
    for logits in out.router_logits:
        top = logits.topk(k + 1)
        assert (top.values[:, k - 1] - top.values[:, k]).min() >= ROUTER_TIE
        picks.append(top.indices[:, :k])
    return picks


def reference_counts(hf, prompts, generated) -> list[int]:
    """Per step of a run that prefills every prompt in its first step and then decodes
    all rows together: the distinct experts of each sparse layer over the step's rows,
    summed. Decode step j feeds back generated token j - 1 (position len(prompt) + j - 1)."""
    picks = [hf_top_k(hf, p + g) for p, g in zip(prompts, generated)]
    num_steps = len(generated[0])  # the prefill, then one step per fed-back token
    counts = []
    for step in range(num_steps):
        total = 0
        for layer in range(len(picks[0])):
            chosen = set()
            for prompt, layers in zip(prompts, picks):
                rows = range(len(prompt)) if step == 0 else [len(prompt) + step - 1]
                chosen |= {int(e) for r in rows for e in layers[layer][r]}
            total += len(chosen)
        counts.append(total)
    return counts


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_engine_counts_the_experts_transformers_router_chooses(kind, tmp_path):
    """qwen3_moe: layer 1 dense (not counted); olmoe: every layer sparse. Six rows of 3
    of 8 experts: each decode step uses more than one row's 3 a layer, and some step
    fewer than all 8 in some layer - neither bound would pass for the count."""
    hf = build_hf_model(kind, tmp_path)
    save_char_tokenizer(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 7, 9, 5, 12, 6)]
    engine = make_engine(tmp_path, max_num_batched_tokens=256)
    assert engine.runner.expert_usage is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    per_step, outputs = [], {}
    while engine.has_unfinished:
        before = engine.stats.moe_experts_used
        for out in engine.step():
            outputs[out.request_id] = out
        per_step.append(engine.stats.moe_experts_used - before)
    generated = [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    expected = reference_counts(hf, prompts, generated)
    assert per_step == expected
    num_sparse = len(hf_top_k(hf, prompts[0]))
    decode = expected[1:]
    assert min(decode) > 3 * num_sparse and min(decode) < 8 * num_sparse, decode


def test_expert_usage_counts_distinct_experts_once_per_call():
    usage = ExpertUsage()
    usage.add(torch.tensor([[0, 3], [3, 5], [0, 5]]), num_experts=8)  # experts 0, 3, 5
    usage.add(torch.tensor([[7, 1]]), num_experts=8)
    assert usage.take() == 5
    assert usage.take() == 0


def test_no_usage_is_tracked_for_a_dense_model(tmp_path):
    build_hf_model("llama", tmp_path)
    save_char_tokenizer(tmp_path)
    engine = make_engine(tmp_path)
    assert engine.runner.expert_usage is None
    engine.add_request("0", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished:
        engine.step()
    assert engine.stats.moe_experts_used == 0
