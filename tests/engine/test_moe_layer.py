"""A mixture-of-experts layer's two pieces (models/moe.py): the router's choices against
transformers' routers, and the PyTorch grouped expert path and the packed native one
against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_moe_kernel import SHAPES, problem, reference, tolerance

from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.models.moe import Experts, Routing, grouped_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_pytorch_grouped_path_matches_float64(shape, dtype):
    x, weights, ids, gate_up, down = problem(shape, dtype, seed=1)
    got = grouped_experts(x, weights, ids, gate_up, down, "silu")
    tol = tolerance(dtype)
    torch.testing.assert_close(
        got.double(), reference(x, weights, ids, gate_up, down), atol=tol, rtol=tol
    )


def test_native_and_pytorch_paths_agree_in_fp32():
    x, weights, ids, gate_up, down = problem(SHAPES[1], torch.float32, seed=2)
    native = moe_kernel.PackedExperts(gate_up, down, "silu")(x, ids, weights)
    torch.testing.assert_close(
        native, grouped_experts(x, weights, ids, gate_up, down, "silu"), atol=1e-5, rtol=1e-5
    )


def test_packing_frees_the_parameters_and_keeps_the_answer():
    x, weights, ids, gate_up, down = problem(SHAPES[0], torch.float32, seed=3)
    experts = Experts(8, 64, 96, "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    before = experts(x, weights, ids)
    assert experts.pack()
    assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
    assert experts.weight_bytes == 4 * (8 * 64 * 2 * 96 + 8 * 96 * 64)
    torch.testing.assert_close(experts(x, weights, ids), before, atol=1e-5, rtol=1e-5)


# transformers' routers, by family: (class, config, our Routing).
ROUTERS = {
    "qwen3_moe": (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter,
                  transformers.Qwen3MoeConfig, dict(norm_topk_prob=True), Routing(3, renormalize=True)),
    "qwen3_moe-plain": (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter,
                        transformers.Qwen3MoeConfig, dict(norm_topk_prob=False), Routing(3, renormalize=False)),
    "mixtral": (transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
                transformers.MixtralConfig, {}, Routing(3, renormalize=True, round_to_model_dtype=False)),
    "olmoe": (transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter,
              transformers.OlmoeConfig, {}, Routing(3, renormalize=False)),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ROUTERS)
def test_routing_matches_transformers_routers(family, dtype):
    router_class, config_class, extra, routing = ROUTERS[family]
    config = config_class(
        hidden_size=32, num_experts_per_tok=3, **{"num_local_experts": 16}, **extra
    )
    router = router_class(config).to(dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
    x = torch.randn(40, 32, generator=g).to(dtype)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = routing.route(torch.nn.functional.linear(x, router.weight))
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


def test_int8_packing_computes_the_dequantized_experts():
    x, weights, ids, gate_up, down = problem(SHAPES[1], torch.float32, seed=7)
    experts = Experts(4, 128, 96, "silu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    assert experts.pack(weight_format="int8")
    assert experts.packed.down.dtype == torch.int8
    gate_up_q, down_q = experts.packed.dequantized()
    want = grouped_experts(x, weights, ids, gate_up_q, down_q, "silu")
    torch.testing.assert_close(experts(x, weights, ids), want, atol=1e-5, rtol=1e-5)
