"""int4 linear layers: PyTorch's int4 kernel, and from UNPACK_MIN_ROWS rows on CPUs with
native bf16 the bf16 matmul on natively expanded weights, compute the product of the dequantized weights
(to bf16's rounding) and stay near the float product."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kernels import int4_unpack
from tokenmill.engine.quant import int4
from tokenmill.engine.quant.int4 import UNPACK_MIN_ROWS, Int4Linear, quantize_weight

needs_native = pytest.mark.skipif(
    not int4_unpack.available(), reason="no C compiler: the native kernels are not built"
)


def test_quantized_weight_reconstructs_within_half_a_step():
    weight = torch.randn(40, 96)
    q, scale, minimum = quantize_weight(weight, 32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    restored = (q.reshape(40, 3, 32).float() * scale[..., None] + minimum[..., None]).reshape(
        40, 96
    )
    step = scale.repeat_interleave(32, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("fast_bf16", [True, False])  # each CPU's route (below)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
@pytest.mark.parametrize("out_features", [80, 128])  # 128: whole int4pack blocks, unpackable
def test_int4_product_equals_the_dequantized_product(
    monkeypatch, fast_bf16, dtype, rows, out_features
):
    monkeypatch.setattr(int4, "cpu_has_fast_bf16", lambda: fast_bf16)
    torch.manual_seed(rows)
    n = out_features
    weight, bias = torch.randn(n, 128) * 0.05, torch.randn(n)
    layer = Int4Linear.from_float(weight, bias, group_size=32)
    assert layer.unpacks == (n % 64 == 0 and int4_unpack.available())
    assert (layer.unpack_min_rows is not None) == (layer.unpacks and fast_bf16)
    q, scale, minimum = quantize_weight(weight, 32)
    dequantized = q.reshape(n, 4, 32).float() * scale[..., None] + minimum[..., None]
    x = torch.randn(rows, 128).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    # Both paths compute in bf16: activations, scales and zeros rounded to bf16 (and the
    # unpacked weights once more).
    scale_b = scale.bfloat16().double()
    zero_b = (minimum + 8 * scale).bfloat16().double()
    restored = (q.reshape(n, 4, 32).double() - 8) * scale_b[..., None] + zero_b[..., None]
    exact = x.bfloat16().double() @ restored.reshape(n, 128).t() + bias.bfloat16().double()
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)
    near = x.double() @ dequantized.reshape(n, 128).double().t() + bias.double()
    assert float((got.double() - near).norm() / near.norm()) < 0.01
    want = x.double() @ weight.double().t() + bias.to(dtype).double()
    # 4 bits with a scale and minimum per 32 weights: ~8% on Gaussian weights.
    assert float((got.double() - want).norm() / want.norm()) < 0.12


@needs_native
@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (192, 576, 32), (128, 256, 64)])
def test_unpacked_weights_are_each_weight_rounded_once_to_bf16(n, k, group):
    torch.manual_seed(n + k)
    q, scale, minimum = quantize_weight(torch.randn(n, k), group)
    layer = Int4Linear(q, scale, minimum, None, group_size=group)
    got = int4_unpack.unpack_int4_bf16(layer.packed_weight, layer.scales_and_zeros, group)
    assert got.shape == (k, n) and got.dtype == torch.bfloat16
    sz = layer.scales_and_zeros.float()  # [k // group, n, 2]
    scale_f = sz[..., 0].t().repeat_interleave(group, dim=1)  # [n, k]
    zero_f = sz[..., 1].t().repeat_interleave(group, dim=1)
    want = ((q.float() - 8) * scale_f + zero_f).bfloat16().t()
    assert torch.equal(got, want)


@needs_native
def test_calls_from_the_threshold_on_run_on_unpacked_weights(monkeypatch):
    monkeypatch.setattr(int4, "cpu_has_fast_bf16", lambda: True)
    torch.manual_seed(3)
    layer = Int4Linear.from_float(torch.randn(128, 64) * 0.05, None, group_size=32)
    calls = []
    real = int4_unpack.unpack_int4_bf16
    monkeypatch.setattr(int4_unpack, "unpack_int4_bf16", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(UNPACK_MIN_ROWS, 64).bfloat16()
    big = layer(x)
    assert len(calls) == 1
    layer(x[: UNPACK_MIN_ROWS - 1])
    assert len(calls) == 1  # below the threshold: PyTorch's int4 kernel
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.packed_weight, 32, layer.scales_and_zeros
    )
    torch.testing.assert_close(big.float(), kernel.float(), rtol=2e-2, atol=2e-2)


@needs_native
def test_without_native_bf16_every_call_runs_the_int4_kernel(monkeypatch):
    # Ice Lake, Cascade Lake, AVX2 CPUs: oneDNN emulates the bf16 matmul the expanded
    # weights would run, at a fraction of the int4 kernel's rate (docs/design.md, "bf16
    # without AVX512-BF16"); the layout is still read, only the route differs.
    monkeypatch.setattr(int4, "cpu_has_fast_bf16", lambda: False)
    torch.manual_seed(4)
    layer = Int4Linear.from_float(torch.randn(128, 64) * 0.05, None, group_size=32)
    assert layer.unpacks and layer.unpack_min_rows is None
    calls = []
    real = int4_unpack.unpack_int4_bf16
    monkeypatch.setattr(int4_unpack, "unpack_int4_bf16", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4 * UNPACK_MIN_ROWS, 64)
    got = layer(x)
    assert not calls
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), layer.packed_weight, 32, layer.scales_and_zeros
    )
    assert torch.equal(got, kernel.float())


@needs_native
def test_a_packing_layout_other_than_the_one_unpacked_keeps_the_int4_kernel():
    q, scale, minimum = quantize_weight(torch.randn(64, 64), 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    assert int4._unpacks(packed, q)
    swapped = torch.cat([packed[:, 16:], packed[:, :16]], dim=1).contiguous()
    assert not int4._unpacks(swapped, q)


@needs_native
@pytest.mark.parametrize(("n", "k"), [(128, 64), (192, 96), (96, 64)])
def test_the_layout_checked_once_per_shape_is_each_weights_own(n, k):
    """A layer trusts the one probe of its shape (_layout_read); the check on its own
    codes agrees, for weights unlike the probe's random codes."""
    for weight in (torch.randn(n, k), torch.zeros(n, k), torch.arange(n * k).view(n, k) % 7):
        q, scale, minimum = quantize_weight(weight.float(), 32)
        layer = Int4Linear(q, scale, minimum, None, group_size=32)
        assert layer.unpacks == int4._unpacks(layer.packed_weight, q) == (n % 64 == 0)


@needs_native
def test_a_weight_packed_a_chunk_of_rows_at_a_time_is_packed_as_a_whole(monkeypatch):
    rows = int4.ROWS_PER_CHUNK + 128  # two chunks, the last short
    weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    # the path taken where the one-pass native packing does not apply
    monkeypatch.setattr(int4, "_quantized_natively", lambda weight, group_size: None)
    chunked = Int4Linear.from_float(weight, group_size=32)
    q, scale, minimum = quantize_weight(weight, 32)
    whole = Int4Linear(q, scale, minimum, None, group_size=32)
    assert chunked.unpacks and whole.unpacks
    assert torch.equal(chunked.packed_weight, whole.packed_weight)
    assert torch.equal(chunked.scales_and_zeros, whole.scales_and_zeros)
    assert chunked.weight_bytes == whole.weight_bytes


def _awkward_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random weights with the groups that test the rounding: a constant group (span 0,
    scale 1), a group of subnormal-sized values, a row a thousand times larger, and
    values exactly half a step from two codes (round half to even)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02
    weight[3, :32] = 0.5
    weight[5, :32] = torch.linspace(1e-39, 3e-39, 32)
    weight[7] *= 1000
    weight[9, :32] = torch.arange(32) % 16 * 1.0
    weight[9, 1] = 15.0  # a span of 15: scale 1, and a code of 7.5 rounds to 8
    weight[9, 2] = 7.5
    weight[11, :32] = -0.0
    return weight.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "group"), [(64, 32, 32), (128, 4096, 32), (192, 512, 64)])
def test_the_one_pass_packing_is_quantize_weight_then_torchs_packing_to_the_bit(dtype, n, k, group):
    weight = _awkward_weight(n, k, dtype)
    packed, scale, minimum = int4_unpack.quantize_pack_int4(weight, group)
    q, want_scale, want_minimum = quantize_weight(weight, group)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
    assert torch.equal(scale, want_scale)
    assert torch.equal(minimum, want_minimum)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_layer_from_the_one_pass_is_the_layer_from_quantize_weight(dtype):
    weight = _awkward_weight(256, 128, dtype)
    bias = torch.randn(256).to(dtype)
    layer = Int4Linear.from_float(weight, bias, group_size=32)
    q, scale, minimum = quantize_weight(weight, 32)
    want = Int4Linear(q, scale, minimum, bias, group_size=32)
    assert layer.unpacks and want.unpacks
    assert torch.equal(layer.packed_weight, want.packed_weight)
    assert torch.equal(layer.scales_and_zeros, want.scales_and_zeros)
    assert layer.weight_bytes == want.weight_bytes
    x = torch.randn(3, 128).to(dtype)
    assert torch.equal(layer(x), want(x))


@needs_native
@pytest.mark.parametrize(
    ("row", "col", "value"),
    [(1, 0, float("nan")), (70, 45, float("nan")), (2, 9, float("inf")), (127, 63, -float("inf"))],
)
def test_the_one_pass_refuses_a_weight_with_a_nan_or_an_infinity(row, col, value):
    """Left to quantize_weight's path (None), never packed from undefined codes."""
    weight = torch.randn(128, 64)
    weight[row, col] = value
    assert int4_unpack.quantize_pack_int4(weight, 32) is None
    assert int4._quantized_natively(weight, 32) is None


@needs_native
def test_the_one_pass_leaves_shapes_it_does_not_pack_to_the_chunked_path():
    # 96 channels are not whole blocks of 64; a float16 weight is not read natively
    assert int4._quantized_natively(torch.randn(96, 64), 32) is None
    assert int4._quantized_natively(torch.randn(128, 64).half(), 32) is None
    assert int4._quantized_natively(torch.randn(128, 512), 512) is None  # group > 256


def test_inputs_not_a_multiple_of_the_group_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 32"):
        quantize_weight(torch.randn(8, 48), 32)
