"""Mixture-of-experts architectures against transformers on the same random weights
(fp32): greedy tokens and log-probs as one transformers forward over the whole sequence
computes them, through `LLM` with chunked prefill and the prefix cache, through an engine
whose cache is too small (preemption), and through a job.

Router ties: where a token's k-th and (k+1)-th router logits in some layer are within
1e-4, either choice of expert is right, and every position from it on may differ; the
comparison stops there for that sequence, and each test checks that such cuts leave
almost every position compared."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import (
    build_hf_model,
    make_engine,
    reset_rotary,
    run_all,
    run_token_prompts_as_job,
    save_char_tokenizer,
)

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import load_config
from tokenmill.engine.models.moe import Experts, MoeConfig
from tokenmill.engine.types.sampling_params import SamplingParams

ROUTER_TIE = 1e-4
ATOL = 2e-4

# name -> build_hf_model arguments (hf_models.MOE holds each family's small shape).
CASES = {
    # 3 of 8 experts, renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(kind="qwen3_moe"),
    # every other layer sparse (decoder_sparse_step 2: layers 1 and 3), not renormalised
    "qwen3_moe-step": dict(
        kind="qwen3_moe",
        num_hidden_layers=4,
        mlp_only_layers=[],
        decoder_sparse_step=2,
        norm_topk_prob=False,
    ),
    # 2 of 8, a window on every layer
    "mixtral": dict(kind="mixtral", sliding_window=20),
    # 3 of 8, not renormalised, q and k normalised over all heads, q/k/v clamped
    "olmoe": dict(kind="olmoe", clip_qkv=1.5),
}


def case_model(name: str, path):
    args = dict(CASES[name])
    hf = build_hf_model(args.pop("kind"), path, **args)
    save_char_tokenizer(path)
    return hf


def prompts_for(seed: int) -> list[list[int]]:
    """Prompts of 3 to 45 tokens, three sharing a 20-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 9, 25)]
    return prompts + [[rng.randrange(256) for _ in range(n)] for n in (3, 14, 30, 41)]


@torch.no_grad()
def hf_reference(hf, token_ids: list[int]) -> tuple[torch.Tensor, int]:
    """One transformers forward: [len - 1, vocab] log-probs (row i scores token i + 1),
    and how many rows are free of router ties (rows from the first tied position on may
    differ either way)."""
    reset_rotary(hf)
    out = hf(torch.tensor([token_ids]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    gaps = torch.stack(
        [(top[:, k - 1] - top[:, k]) for top in (r.topk(k + 1).values for r in out.router_logits)]
    )
    tied = (gaps.min(0).values < ROUTER_TIE).nonzero()
    exact_rows = int(tied[0]) if len(tied) else len(token_ids) - 1
    return torch.log_softmax(out.logits[0, :-1].float(), -1), exact_rows


class Compared:
    """Counts the positions compared and those a router tie left out."""

    def __init__(self) -> None:
        self.compared = self.left_out = 0

    def check_generated(self, prompt, generated, logprob_entries, hf) -> None:
        """Each generated token is the reference's argmax; its top log-probs match."""
        reference, exact_rows = hf_reference(hf, prompt + generated)
        for step, (token, entry) in enumerate(zip(generated, logprob_entries)):
            row = len(prompt) - 1 + step
            if row >= exact_rows:
                self.left_out += len(generated) - step
                return
            want = reference[row]
            assert token == int(want.argmax())
            ours = torch.tensor(list(entry.values()))
            torch.testing.assert_close(ours, want[list(entry.keys())], atol=ATOL, rtol=1e-4)
            self.compared += 1

    def check_output(self, out, prompt, hf) -> None:
        """An LLM output, its prompt log-probs too where it has them."""
        completion = out.outputs[0]
        self.check_generated(prompt, completion.token_ids, completion.logprobs, hf)
        if out.prompt_logprobs is None:
            return
        reference, exact_rows = hf_reference(hf, prompt + completion.token_ids)
        assert out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            if i >= exact_rows:
                self.left_out += len(prompt) - 1 - i
                break
            assert prompt[i + 1] in entry
            ours = torch.tensor(list(entry.values()))
            want = reference[i][list(entry.keys())]
            torch.testing.assert_close(ours, want, atol=ATOL, rtol=1e-4)
            self.compared += 1

    def assert_mostly_compared(self) -> None:
        assert self.compared > 0 and self.left_out <= 0.1 * (self.compared + self.left_out)


def native_experts(model) -> list[Experts]:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.packed is not None for e in experts)  # the grouped kernel ran
    return experts


@pytest.mark.parametrize("name", CASES)
def test_moe_matches_one_transformers_forward(name, tmp_path):
    hf = case_model(name, tmp_path)
    config = load_config(tmp_path)
    assert isinstance(config, MoeConfig)
    # Which layers have experts: as transformers built them.
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    hf_sparse += [
        i for i, layer in enumerate(hf.model.layers) if hasattr(layer, "block_sparse_moe")
    ]
    assert [i for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)] == hf_sparse
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,  # chunked prefill
        enable_prefix_caching=True,
    )
    assert len(native_experts(llm.engine.runner.model)) == len(hf_sparse)
    prompts = prompts_for(seed=len(name))
    compared = Compared()
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    # Again without prompt log-probs, so that the cached prefixes are served.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    assert llm.engine.stats.cached_prompt_tokens > 0
    compared.assert_mostly_compared()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_moe_matches_transformers_under_preemption(name, tmp_path):
    """A cache of 24 blocks of 4 tokens for ~300 tokens of sequences: requests are
    preempted and recomputed, prefills chunked, and the answers are still transformers'."""
    hf = case_model(name, tmp_path)
    prompts = prompts_for(seed=11)
    config = load_config(tmp_path)
    block_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    engine = make_engine(
        tmp_path,
        kv_cache_memory=24 * block_bytes * 4 * 4,  # k and v, fp32, 4 tokens a block
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        max_num_seqs=8,  # set: admitted by their prompt alone, so decode preempts
    )
    assert engine.block_manager.num_blocks == 24
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = run_all(engine, prompts, params)
    assert engine.stats.num_preemptions > 0
    compared = Compared()
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length"
        compared.check_generated(prompt, out.outputs[0].token_ids, out.outputs[0].logprobs, hf)
    compared.assert_mostly_compared()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_moe_matches_transformers_through_a_job(name, tmp_path):
    """The same through `run_job`: each row's text is its tokens (one character each)."""
    model_dir = tmp_path / "model"
    hf = case_model(name, model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = prompts_for(seed=7)
    results = run_token_prompts_as_job(model_dir, prompts, tmp_path / "out")
    compared = Compared()
    for prompt, row in zip(prompts, results):
        generated = tokenizer.encode(row["output"])
        assert len(generated) == 8 and row["finish_reason"] == "length"
        entries = [{t: e["logprob"]} for t, e in zip(generated, row["logprobs"])]
        compared.check_generated(prompt, generated, entries, hf)
    compared.assert_mostly_compared()


def test_quantizations_the_experts_cannot_take_are_refused_before_loading(tmp_path):
    case_model("qwen3_moe", tmp_path)  # experts of 48: not whole groups of 32
    with pytest.raises(
        ValueError, match="quantization='gguf' does not quantize the experts .*Qwen3MoeForCausalLM"
    ):
        LLM(str(tmp_path), dtype="float32", quantization="gguf")
    with pytest.raises(ValueError, match="multiples of 32.*moe_intermediate_size 48"):
        LLM(str(tmp_path), dtype="float32", quantization="int4")


def test_int8_moe_engine_tracks_the_float_engine(tmp_path):
    """quantization="int8": the dense projections as for dense models (SmoothQuant W8A8),
    the experts int8 with a scale per output column in the grouped kernel."""
    from test_quantized_model import PARAMS, compare

    case_model("qwen3_moe", tmp_path)
    prompts = prompts_for(seed=9)
    reference = run_all(make_engine(tmp_path), prompts, PARAMS)
    engine = make_engine(tmp_path, quantization="int8")
    experts = native_experts(engine.runner.model)
    assert all(e.packed.gate_up.dtype == torch.int8 for e in experts)
    mean_diff, agree, total = compare(run_all(engine, prompts, PARAMS), reference)
    print(f"\nqwen3_moe int8: prompt logprob |diff| mean {mean_diff:.4f}, agree {agree}/{total}")
    # The dense models' bounds (test_quantized_model.py): the random model's peaked
    # distributions magnify rounding.
    assert mean_diff < 0.2
    assert agree >= total * 0.6


def test_int4_moe_engine_computes_the_float_model_of_its_dequantized_weights(tmp_path, monkeypatch):
    """quantization="int4": the dense projections and the experts in groups of 32; a
    float engine given the dequantized weights computes nearly the same (the dense int4
    products run in bf16, as for dense models: test_quantized_model.py)."""
    from test_quantized_model import INT4_GROUP_SIZE, PARAMS, compare

    from tokenmill.engine.kernels import moe as moe_kernel
    from tokenmill.engine.quant import int4, quantized_targets

    build_hf_model("qwen3_moe", tmp_path, moe_intermediate_size=64)  # whole groups of 32
    save_char_tokenizer(tmp_path)
    prompts = prompts_for(seed=9)
    engine = make_engine(tmp_path, quantization="int4")
    experts = native_experts(engine.runner.model)
    assert all(e.packed.gate_up.dtype == torch.uint8 for e in experts)
    outputs = run_all(engine, prompts, PARAMS)

    monkeypatch.setenv("TOKENMILL_PACKED_LINEAR", "0")  # keep nn.Linear to set weights
    reference_engine = make_engine(tmp_path)
    with torch.no_grad():
        for _, _, linear in quantized_targets(reference_engine.runner.model):
            q, scale, minimum = int4.quantize_weight(linear.weight, INT4_GROUP_SIZE)
            n, k = q.shape
            groups = q.reshape(n, k // INT4_GROUP_SIZE, -1).float()
            linear.weight.copy_((groups * scale[..., None] + minimum[..., None]).reshape(n, k))
    for held, float_experts in zip(experts, native_experts(reference_engine.runner.model)):
        gate_up, down = held.packed.dequantized()
        float_experts.packed = moe_kernel.PackedExperts(gate_up, down, held.activation)
    mean_diff, agree, total = compare(outputs, run_all(reference_engine, prompts, PARAMS))
    print(f"\nqwen3_moe int4 vs fp32 on its dequantized weights: |diff| mean {mean_diff:.4f}, "
          f"agree {agree}/{total}")  # fmt: skip
    assert mean_diff < 0.1
    assert agree >= total * 0.7


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
            r"missing weights: model.layers.2.mlp.experts.gate_up_proj\[1\] of expert 5",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.8.down_proj.weight": torch.ones(64, 48)}
            ),
            r"experts.8.down_proj.weight is expert 8 of 8",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.experts.1.up_proj.bias": torch.ones(48)}),
            r"no place for: model.layers.0.mlp.experts.1.up_proj.bias",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.2.gate_proj.weight": torch.ones(40, 64)}
            ),
            r"experts.2.gate_proj.weight has shape \(40, 64\), expected \(48, 64\)",
        ),
    ],
)
def test_expert_tensors_are_checked_by_name_before_any_read(edit, message, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tokenmill.engine.loader import weights

    case_model("qwen3_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights, "iter_tensors", read)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), dtype="float32")


def test_experts_stored_stacked_load_as_per_expert_ones(tmp_path):
    """A checkpoint that keeps each layer's experts as one stacked tensor per projection
    (transformers' own parameters) gives the same model as one tensor per expert."""
    from safetensors.torch import load_file, save_file

    hf = case_model("qwen3_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in (0, 2):  # layer 1 is dense
        prefix = f"model.layers.{layer}.mlp.experts"
        per = {
            p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(8)]
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        gate_up = [torch.cat(pair) for pair in zip(per["gate_proj"], per["up_proj"])]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(per["down_proj"])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32")
    prompts = prompts_for(seed=5)[:3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    compared = Compared()
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    compared.assert_mostly_compared()


def test_model_info_counts_the_parameters_a_token_runs_through(tmp_path):
    from tokenmill.engine import model_info

    hf = case_model("qwen3_moe", tmp_path)  # layers 0 and 2 sparse, 3 of 8 experts
    info = model_info(tmp_path)
    assert info.num_parameters == sum(p.numel() for p in hf.parameters())
    experts = [layer.mlp.experts for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    per_expert = sum(p[0].numel() for e in experts for p in (e.gate_up_proj, e.down_proj))
    assert len(experts) == 2 and per_expert == 2 * 3 * 64 * 48
    assert info.num_active_parameters == info.num_parameters - (8 - 3) * per_expert
    dense = tmp_path / "dense"
    build_hf_model("qwen3", dense)
    save_char_tokenizer(dense)
    assert model_info(dense).num_active_parameters is None


def test_bench_shape_counts_the_weights_a_token_runs_and_a_step_reads(tmp_path):
    """The bench's FLOPs (and so its roofline) count a token's router and top-k experts,
    not every expert; a decode step of many rows reads every expert once."""
    from tokenmill.bench.flops import ModelShape

    hf = case_model("qwen3_moe", tmp_path)  # layers 0 and 2 sparse, 3 of 8 experts
    shape = ModelShape.from_dir(tmp_path)
    attention = dense = sparse_fixed = per_expert = 0
    for layer in hf.model.layers:
        attn = layer.self_attn
        attention += sum(
            m.weight.numel() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        if hasattr(layer.mlp, "gate"):  # sparse: a router and 8 experts
            sparse_fixed += layer.mlp.gate.weight.numel()
            experts = layer.mlp.experts
            per_expert += sum(p[0].numel() for p in (experts.gate_up_proj, experts.down_proj))
        else:
            dense += sum(p.numel() for p in layer.mlp.parameters())
    assert shape.num_sparse_layers == 2 and per_expert == 2 * 3 * 64 * 48
    assert shape.layer_matmul_params == attention + dense + sparse_fixed + 3 * per_expert
    assert shape.layer_params_read(1) == pytest.approx(shape.layer_matmul_params)
    every_expert = attention + dense + sparse_fixed + 8 * per_expert
    assert shape.layer_params_read(10_000) == pytest.approx(every_expert)
    # two rows choose 8 * (1 - (5/8)^2) = 4.875 distinct experts a layer, on average
    assert shape.layer_params_read(2) == pytest.approx(
        attention + dense + sparse_fixed + 4.875 * per_expert
    )
