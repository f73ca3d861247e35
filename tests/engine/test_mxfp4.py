"""MXFP4 (quant/mxfp4.py): the packer written here from the OCP MX spec, read back by
transformers' own gpt-oss dequantizer; and the grouped expert kernel reading MXFP4 as
stored, against the fp32 kernel over the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from test_moe_kernel import clamped_swiglu_reference, problem

from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.quant import mxfp4


def test_the_packer_round_trips_through_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    assert blocks.dtype == scales.dtype == torch.uint8
    ours = mxfp4.dequantize(blocks, scales)
    # transformers returns the [experts, in, out] parameter gpt-oss multiplies by.
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))
    # Each value within half an e2m1 step of its block's scale: at most 1/4 of its
    # block's largest magnitude for the values that use the top step (4 -> 6).
    largest = w.reshape(3, 40, 3, 32).abs().amax(-1).repeat_interleave(32, -1)
    assert ((ours - w).abs() <= largest / 4 + 1e-12).all()


def test_the_packer_rounds_as_the_spec_says():
    """A block whose largest magnitude is in [4, 8) has scale 2^0: its values round to the
    nearest e2m1, halfway ones to the even mantissa, and past 6 clamp to 6."""
    values = [0.25, 0.75, 1.25, 2.5, 5.0, -0.75, 7.0, 3.2] + [0.0] * 24
    blocks, scales = mxfp4.quantize(torch.tensor([values]))
    assert scales.tolist() == [[127]]
    got = mxfp4.dequantize(blocks, scales)[0, :8].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 4.0, -1.0, 6.0, 3.0]
    # A zero block keeps every code 0.
    blocks, scales = mxfp4.quantize(torch.zeros(1, 32))
    assert blocks.eq(0).all() and mxfp4.dequantize(blocks, scales).eq(0).all()


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 32 values, not 40"):
        mxfp4.quantize(torch.ones(2, 40))


SHAPES = [(8, 64, 96, 5, 2), (4, 128, 96, 70, 2), (3, 32, 64, 9, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp4_experts_equal_fp32_experts_on_their_dequantized_weights(shape, dtype):
    """e2m1 times a power of two is exact in fp32, so the kernel's MXFP4 sums are the fp32
    path's over the dequantized weights - bit for bit with fp32 activations."""
    x, weights, ids, gate_up, down = problem(shape, torch.float32, seed=5)
    num_experts, hidden, inter, _, _ = shape
    g = torch.Generator().manual_seed(8)
    biases = dict(
        gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g) * 0.2,
        down_bias=torch.randn(num_experts, hidden, generator=g) * 0.2,
        swiglu=(1.702, 0.5),
    )
    gate_up_q, down_q = mxfp4.quantize(gate_up), mxfp4.quantize(down)
    packed = moe_kernel.PackedExperts.from_mxfp4(
        gate_up_q, down_q, dtype, "clamped_swiglu", **biases
    )
    dense_gate_up, dense_down = mxfp4.dequantize(*gate_up_q), mxfp4.dequantize(*down_q)
    assert all(torch.equal(a, b) for a, b in zip(packed.dequantized(), (dense_gate_up, dense_down)))
    # 4 bits a weight and a byte per 32 inputs of a column (the columns in whole panels of
    # 64), and the fp32 biases: nothing widened.
    gate_up_cols = moe_kernel.panel_count(2 * inter, gated=True) * moe_kernel.PANEL_COLS
    down_cols = moe_kernel.panel_count(hidden, gated=False) * moe_kernel.PANEL_COLS
    assert packed.weight_bytes == num_experts * (
        hidden * gate_up_cols // 2
        + hidden // 32 * gate_up_cols
        + inter * down_cols // 2
        + inter // 32 * down_cols
        + 4 * (2 * inter + hidden)
    )
    x = x.to(dtype)
    got = packed(x, ids, weights)
    if dtype == torch.float32:
        dense = moe_kernel.PackedExperts(dense_gate_up, dense_down, "clamped_swiglu", **biases)
        assert torch.equal(got, dense(x, ids, weights))
    want = clamped_swiglu_reference(
        x,
        weights,
        ids,
        dense_gate_up,
        dense_down,
        biases["gate_up_bias"],
        biases["down_bias"],
        1.702,
        0.5,
    )
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
