"""int4 linear layers: PyTorch's int4 kernel computes the product of the dequantized
weights exactly (to the activation dtype's rounding), and stays near the float product."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.quant.int4 import Int4Linear, quantize_weight


def test_quantized_weight_reconstructs_within_half_a_step():
    weight = torch.randn(40, 96)
    q, scale, minimum = quantize_weight(weight, 32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    restored = (q.reshape(40, 3, 32).float() * scale[..., None] + minimum[..., None]).reshape(
        40, 96
    )
    step = scale.repeat_interleave(32, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
def test_int4_product_equals_the_dequantized_product(dtype, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(80, 128) * 0.05, torch.randn(80)
    layer = Int4Linear.from_float(weight, bias, group_size=32)
    q, scale, minimum = quantize_weight(weight, 32)
    dequantized = q.reshape(80, 4, 32).float() * scale[..., None] + minimum[..., None]
    x = torch.randn(rows, 128).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    # The kernel computes in bf16: activations, scales and zeros rounded to bf16.
    scale_b = scale.bfloat16().double()
    zero_b = (minimum + 8 * scale).bfloat16().double()
    restored = (q.reshape(80, 4, 32).double() - 8) * scale_b[..., None] + zero_b[..., None]
    exact = x.bfloat16().double() @ restored.reshape(80, 128).t() + bias.bfloat16().double()
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)
    near = x.double() @ dequantized.reshape(80, 128).double().t() + bias.double()
    assert float((got.double() - near).norm() / near.norm()) < 0.01
    want = x.double() @ weight.double().t() + bias.to(dtype).double()
    # 4 bits with a scale and minimum per 32 weights: ~8% on Gaussian weights.
    assert float((got.double() - want).norm() / want.norm()) < 0.12


def test_inputs_not_a_multiple_of_the_group_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 32"):
        quantize_weight(torch.randn(8, 48), 32)
