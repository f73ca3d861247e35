"""The one-row bf16 linear on oneDNN's packed weights (engine/kernels/packed_matvec.c):
the kernel against float64 on every block width it reads, odd pair counts, a bias and
both thread counts; the plain-loop build other CPUs get; the shapes it refuses; and
PackedLinear's use of it - only where the layout is proven, never with a stale weight."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import OTHER_CPUS, build_with
from torch import nn
from torch.nn import functional as F

from tokenmill.engine import kernels
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels import packed_matvec as matvec_kernel
from tokenmill.engine.kernels.packed_matvec import PackedMatvec
from tokenmill.engine.quant.packed_linear import PackedLinear, one_row_block_cols, packs_dtype


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if native_library() is None:
        pytest.fail("the native kernel did not build; is a C compiler installed?")


def packed_layout(weight: torch.Tensor, block_cols: int) -> torch.Tensor:
    """[out, in] -> kernels.h's layout: [out / bc][in / 2][bc][2], flattened."""
    out_features, in_features = weight.shape
    blocks = weight.view(out_features // block_cols, block_cols, in_features // 2, 2)
    return blocks.permute(0, 2, 1, 3).contiguous().view(-1)


def reference(x, weight, bias):
    want = x.double() @ weight.double().T
    return want if bias is None else want + bias.double()


def operands(out_features, in_features, seed, with_bias):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(1, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    return x, weight, bias


def assert_matches(got, want):
    # fp32 sums of in_features bf16 products, rounded once to bf16 (2^-8 relative)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=8e-3 * scale, rtol=8e-3)


# (out, in): 70 = 35 pairs (the odd last pair), 1536 x 576 = 1.7 MB (split over threads).
SHAPES = [(64, 70), (192, 576), (1536, 576)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("block_cols", matvec_kernel.BLOCK_COLS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_matches_float64(out_features, in_features, block_cols, with_bias, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, weight, bias = operands(out_features, in_features, block_cols + threads, with_bias)
    call = PackedMatvec(
        packed_layout(weight, block_cols), in_features, out_features, block_cols, bias
    )
    got = call(x)
    assert got.shape == (1, out_features) and got.dtype == torch.bfloat16
    assert_matches(got, reference(x, weight, bias))


@OTHER_CPUS
def test_kernel_built_for_other_cpus_matches_float64(flags, tmp_path, monkeypatch):
    variant = build_with(flags, tmp_path)
    assert not variant.limits.packed_matvec_vector
    monkeypatch.setattr(matvec_kernel, "_library", lambda: variant.lib)
    for block_cols in matvec_kernel.BLOCK_COLS:
        x, weight, bias = operands(192, 70, block_cols, True)
        call = PackedMatvec(packed_layout(weight, block_cols), 70, 192, block_cols, bias)
        assert_matches(call(x), reference(x, weight, bias))


def test_this_cpu_gets_its_fastest_path(cpu_path):
    vector = native_library().limits.packed_matvec_vector
    cpu_path("one-row bf16 linear", "avx512_bf16" if vector else "plain loops (oneDNN used)")
    assert vector == ({"avx512f", "avx512bw", "avx512_bf16"} <= kernels.cpu_flags())


@pytest.mark.parametrize(
    ("shape", "block_cols", "size"),
    [
        ((64, 70), 24, None),  # a width the kernel does not read
        ((48, 70), 32, None),  # outputs not whole blocks
        ((64, 71), 16, None),  # odd k: no pairs
        ((64, 70), 16, 64 * 70 - 2),  # storage of another size
    ],
)
def test_bad_layouts_are_refused(shape, block_cols, size):
    out_features, in_features = shape
    weight = torch.zeros(size or out_features * in_features, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        PackedMatvec(weight, in_features, out_features, block_cols, None)


needs_bf16_packing = pytest.mark.skipif(
    not packs_dtype(torch.bfloat16), reason="oneDNN packs no bf16 weights on this CPU"
)


@needs_bf16_packing
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536)])
def test_packed_linear_takes_one_row_to_the_kernel(out_features, in_features, with_bias):
    """On the real packed weight: where the kernel runs vdpbf16ps the layer uses it for
    one row and matches F.linear; batches stay with oneDNN."""
    linear = nn.Linear(in_features, out_features, bias=with_bias).bfloat16()
    packed = PackedLinear(linear)
    assert (packed.one_row is not None) == matvec_kernel.vectorized()
    for rows in (1, 5):
        x = torch.randn(rows, in_features).bfloat16()
        want = F.linear(
            x.double(),
            linear.weight.double(),
            None if linear.bias is None else linear.bias.double(),
        )
        got = packed(x)
        torch.testing.assert_close(
            got.double(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2
        )


@needs_bf16_packing
def test_only_the_layouts_width_passes_the_check():
    """Every width that tiles the layer is tried; the check tells the layout's own from the
    others (which read the same bytes as other outputs' weights)."""
    linear = nn.Linear(576, 960, bias=False).bfloat16()
    packed = PackedLinear(linear)
    found = one_row_block_cols(packed)
    if not matvec_kernel.vectorized():
        assert packed.one_row is None
    assert found in (None, *matvec_kernel.BLOCK_COLS)
    x = torch.randn(1, 576).bfloat16()
    want = F.linear(x, linear.weight).float()
    scale = want.abs().max().item()
    for block_cols in matvec_kernel.BLOCK_COLS:
        got = packed._matvec(block_cols)(x).float()
        close = torch.allclose(got, want, rtol=2e-2, atol=2e-2 * scale)
        assert close == (block_cols == found), block_cols


@needs_bf16_packing
def test_a_layer_no_width_tiles_stays_with_onednn():
    """100 outputs are no whole number of 16-, 32- or 64-wide blocks."""
    linear = nn.Linear(70, 100, bias=False).bfloat16()
    packed = PackedLinear(linear)
    assert one_row_block_cols(packed) is None and packed.one_row is None
    x = torch.randn(1, 70).bfloat16()
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight), atol=2e-2, rtol=2e-2)


@needs_bf16_packing
def test_a_replaced_weight_is_never_read_through_the_old_call():
    linear = nn.Linear(576, 192, bias=False).bfloat16()
    packed = PackedLinear(linear)
    other = nn.Linear(576, 192, bias=False).bfloat16()
    packed.packed_weight = torch.ops.mkldnn._reorder_linear_weight(other.weight.detach(), None)
    x = torch.randn(1, 576).bfloat16()
    torch.testing.assert_close(packed(x), F.linear(x, other.weight), atol=2e-2, rtol=2e-2)
