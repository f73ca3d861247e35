"""A mixture of experts' experts are packed as each layer fills during the load (float,
int8 or int4, as the engine will run them), so the float stacks of every layer are never
in memory at once: the order of that, the outputs against packing after the whole load
(the path before it), and the memory plan's count of the load's peak."""

from __future__ import annotations

import pytest
import torch
from hf_models import build_hf_model, run_all, save_char_tokenizer
from test_moe_models import prompts_for
from test_quantized_model import PARAMS, compare

from tokenmill.engine.api.llm import build_engine
from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.loader.tensor_plan import build_on_meta
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.loader.weights import load_model
from tokenmill.engine.models import load_config
from tokenmill.engine.models.moe import Experts, expert_packer
from tokenmill.engine.quant import quantized_targets
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.worker import build
from tokenmill.engine.worker.memory import load_bytes

CPU = torch.device("cpu")
SPARSE_LAYERS = (0, 2, 3)  # layer 1 is dense (mlp_only_layers)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Qwen3-MoE in small: 4 layers, 8 experts of 64 (whole int4 groups), layer 1 dense."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    build_hf_model("qwen3_moe", path, num_hidden_layers=4, moe_intermediate_size=64)
    save_char_tokenizer(path)
    return path


def layer_experts(model) -> dict[int, Experts]:
    return {
        i: layer.mlp.experts for i, layer in enumerate(model.model.layers) if i in SPARSE_LAYERS
    }


def test_each_layer_is_packed_before_the_next_layers_experts_take_memory(moe_dir):
    """When layer L's experts are complete, every earlier layer's are packed with their
    float stacks released, and no later layer's stack has memory yet: one layer's float
    experts at most are alive beside the packed ones."""
    pack = expert_packer("int8")
    packed_order, called, built = [], [], []

    def on_filled(model, name):
        module = model.get_submodule(name)
        built.append(model)
        called.append(module)
        if isinstance(module, Experts):
            layers = layer_experts(model)
            now = next(i for i, e in layers.items() if e is module)
            for i, experts in layers.items():
                stacks_meta = [experts.gate_up_proj.is_meta, experts.down_proj.is_meta]
                if i < now:  # packed, its float stacks gone
                    assert experts.packed is not None and stacks_meta == [True, True], i
                elif i == now:
                    assert experts.packed is None and stacks_meta == [False, False], i
                else:  # not one of its tensors read yet: no memory
                    assert experts.packed is None and stacks_meta == [True, True], i
            packed_order.append(now)
        pack(model, name)

    config = load_config(moe_dir)
    model = load_model(moe_dir, config, dtype=torch.bfloat16, device=CPU, on_filled=on_filled)
    assert all(m is model for m in built)
    assert packed_order == list(SPARSE_LAYERS)
    for experts in layer_experts(model).values():
        assert experts.packed.gate_up.dtype == torch.int8
        assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
    # Every module with parameters of its own was called once, when they were complete.
    with_params = [
        m for m in model.modules() if next(m.parameters(recurse=False), None) is not None
    ]
    assert len(called) == len(with_params) and set(map(id, called)) == set(map(id, with_params))


def bf16_engine(model_dir, **settings):
    config = EngineConfig(
        block_size=4, kv_cache_memory=8 << 20, max_num_batched_tokens=64, **settings
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    return build_engine(model_dir, config, dtype=torch.bfloat16, device=CPU, tokenizer=tokenizer)


def packed_after_the_load(monkeypatch):
    """The path before: nothing packed during the load, every layer after it (quantize's
    own loop and pack_experts)."""
    monkeypatch.setattr(build, "expert_packer", lambda weight_format: lambda model, name: None)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_packing_during_the_load_runs_the_model_packing_after_it_ran(
    quantization, moe_dir, monkeypatch
):
    prompts = prompts_for(seed=9)
    engine = bf16_engine(moe_dir, quantization=quantization)
    outputs = run_all(engine, prompts, PARAMS)
    with monkeypatch.context() as patch:
        packed_after_the_load(patch)
        reference_engine = bf16_engine(moe_dir, quantization=quantization)
    reference = run_all(reference_engine, prompts, PARAMS)
    # The experts themselves are the same bytes either way.
    for ours, theirs in zip(
        layer_experts(engine.runner.model).values(),
        layer_experts(reference_engine.runner.model).values(),
    ):
        assert ours.packed.weight_format == theirs.packed.weight_format
        assert torch.equal(ours.packed.gate_up, theirs.packed.gate_up)
        assert torch.equal(ours.packed.down, theirs.packed.down)
    if quantization != "int8":
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
        assert [o.prompt_logprobs for o in outputs] == [r.prompt_logprobs for r in reference]
        return
    # int8's calibration pass now runs with the experts in int8 (quant/int8.py), so the
    # dense layers' smoothing differs by that rounding - by much less than int8 itself
    # moves the model from the float one.
    float_outputs = run_all(bf16_engine(moe_dir), prompts, PARAMS)
    change, _, _ = compare(outputs, reference)
    int8_error, _, _ = compare(reference, float_outputs)
    print(f"\nint8 prompt logprob |diff| mean: {change:.4f} to packing after the load, "
          f"{int8_error:.4f} from there to bf16")  # fmt: skip
    assert 0 < change < 0.5 * int8_error


@pytest.mark.parametrize(
    ("quantization", "weight_format"), [(None, "float"), ("int8", "int8"), ("int4", "int4")]
)
def test_the_memory_plan_counts_the_loads_peak(quantization, weight_format, moe_dir):
    """The weights planned are what the load holds at its peak: the float parameters
    but the experts, every layer's experts as packed, and the largest layer's float ones
    (the stacks being filled) - and under int4, which swaps the dense linear layers as
    they fill too, those quantized plus the largest one's float weight."""
    config = load_config(moe_dir)
    meta = build_on_meta(config, torch.bfloat16)
    dense = [p.numel() * 2 for _, _, lin in quantized_targets(meta) for p in lin.parameters()]
    model = load_model(
        moe_dir, config, dtype=torch.bfloat16, device=CPU, on_filled=build._on_filled(quantization)
    )
    packed = [e.packed for e in layer_experts(model).values()]
    assert all(p.weight_format == weight_format for p in packed)
    float_layers = [
        sum(p.numel() * 2 for p in (e.gate_up_proj, e.down_proj))
        for e in layer_experts(model).values()
    ]
    float_total = load_bytes(config, torch.bfloat16)
    peak = float_total - sum(float_layers) + sum(p.weight_bytes for p in packed) + max(float_layers)
    if quantization == "int4":
        int4_layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
        assert len(int4_layers) == len(dense)  # no biases here: one weight each
        peak += sum(m.weight_bytes for m in int4_layers) + max(dense) - sum(dense)
    planned = build.plan_memory(
        config, EngineConfig(quantization=quantization), dtype=torch.bfloat16, device=CPU
    )
    assert planned.weight_bytes == peak
    if quantization is not None:
        assert peak < float_total
    # Where the native kernel does not run the experts (not a CPU), they load float.
    elsewhere = load_bytes(
        config, torch.bfloat16, expert_format=weight_format, device=torch.device("meta")
    )
    assert elsewhere == float_total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_format", ["float", "int8", "int4"])
def test_packed_bytes_is_the_packing_size(weight_format, dtype):
    gate_up, down = torch.randn(3, 2 * 64, 96, dtype=dtype), torch.randn(3, 96, 64, dtype=dtype)
    packed = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format)
    assert moe_kernel.packed_bytes(3, 96, 64, dtype, weight_format) == packed.weight_bytes
    biased = moe_kernel.PackedExperts(
        gate_up,
        down,
        "silu",
        weight_format,
        gate_up_bias=torch.randn(3, 2 * 64, dtype=dtype),
        down_bias=torch.randn(3, 96, dtype=dtype),
    )
    assert moe_kernel.packed_bytes(3, 96, 64, dtype, weight_format, biases=True) == (
        biased.weight_bytes
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_bytes_is_the_mxfp4_packing_size(dtype):
    def stored(n, k):  # random MXFP4 codes and scales as a checkpoint holds them
        blocks = torch.randint(0, 256, (3, n, k // 32, 16), dtype=torch.uint8)
        return blocks, torch.randint(120, 130, (3, n, k // 32), dtype=torch.uint8)

    packed = moe_kernel.PackedExperts.from_mxfp4(
        stored(2 * 64, 96),
        stored(96, 64),
        dtype,
        "clamped_swiglu",
        gate_up_bias=torch.randn(3, 2 * 64),
        down_bias=torch.randn(3, 96),
    )
    assert moe_kernel.packed_bytes(3, 96, 64, dtype, "mxfp4", biases=True) == packed.weight_bytes


def test_experts_quantized_a_few_at_a_time_are_the_whole_stack_quantized():
    """quantize_int8 / quantize_int4 take a few experts at a time (9 here: a last chunk
    short); each row is its own, so the codes are the whole-stack formula's."""
    torch.manual_seed(0)
    w = torch.randn(9, 16, 64, dtype=torch.bfloat16)
    q, scales = moe_kernel.quantize_int8(w)
    whole_scales = w.float().abs().amax(dim=-1).clamp(min=1e-12) / 127
    assert torch.equal(scales, whole_scales)
    assert torch.equal(q, torch.round(w.float() / whole_scales[..., None]).to(torch.int8))
    q4, scale, minimum = moe_kernel.quantize_int4(w)
    groups = w.float().reshape(9, 16, 2, 32)
    whole_min = groups.amin(dim=-1).to(torch.bfloat16)
    span = groups.amax(dim=-1) - whole_min.float()
    whole_scale = (span / 15).to(torch.bfloat16)
    codes = torch.round((groups - whole_min.float()[..., None]) / whole_scale.float()[..., None])
    assert torch.equal(minimum, whole_min) and torch.equal(scale, whole_scale)
    assert torch.equal(q4, codes.clamp(0, 15).to(torch.uint8).reshape(9, 16, 64))
