"""A vision tower's bidirectional attention on AMX tiles (engine/kernels/vision_attention.c)
against PyTorch's attention in fp32 on the same bf16 inputs: head_dim 72 (SigLIP's) and
64, sequences that are not whole tiles or chunks, several images, views into one qkv
projection, one to three threads; the shapes and layouts it refuses; the build other CPUs
get, which refuses the call and leaves the towers on PyTorch's attention."""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_builds import build_with
from torch.nn import functional as F

from tokenmill.engine import kernels
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels import vision_attention as kernel
from tokenmill.engine.kernels.interface import UNSUPPORTED_ISA, VisionAttentionArgs
from tokenmill.engine.models.siglip import SiglipAttention, VisionConfig

needs_kernel = pytest.mark.skipif(
    not kernel.available(), reason="tm_vision_attention runs only with AMX-BF16 tiles"
)


def operands(images, patches, heads, head_dim, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    shape = (images, patches, 3 * heads * head_dim)
    qkv = (torch.randn(shape, generator=g) * spread).bfloat16()
    return qkv.chunk(3, dim=-1)  # views: tokens 3 * hidden apart


def reference(q, k, v, heads, scale):
    """fp32 attention on the bf16 inputs' values."""
    images, patches, hidden = q.shape

    def split(t):
        return t.float().reshape(images, patches, heads, hidden // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale)
    return out.transpose(1, 2).reshape(images, patches, hidden)


def bf16_error(q, k, v, heads, scale):
    """PyTorch's own bf16 attention's largest error against fp32: the rounding budget."""
    want = reference(q, k, v, heads, scale)
    images, patches, hidden = q.shape

    def split(t):
        return t.reshape(images, patches, heads, hidden // heads).transpose(1, 2)

    theirs = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale)
    theirs = theirs.transpose(1, 2).reshape(images, patches, hidden)
    return (theirs.float() - want).abs().max().item()


# (images, patches, heads, head_dim): one patch; fewer than a tile; just past a tile and a
# chunk of 128 keys; several chunks with a partial last one; head_dim 72 (SigLIP), 64, and
# ones the tiles pad (40, 128 and 136 channels).
SHAPES = [
    (1, 1, 2, 72),
    (2, 5, 3, 72),
    (1, 33, 2, 64),
    (3, 129, 2, 72),
    (1, 300, 1, 40),
    (2, 517, 2, 72),
    (1, 200, 1, 128),
    (1, 70, 2, 136),
]


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("images", "patches", "heads", "head_dim"), SHAPES)
def test_matches_fp32_attention(images, patches, heads, head_dim, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    q, k, v = operands(images, patches, heads, head_dim, seed=patches + head_dim)
    scale = head_dim**-0.5
    got = kernel.vision_attention(q, k, v, heads, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = reference(q, k, v, heads, scale)
    # bf16 weights and one rounding of the output: as close as PyTorch's bf16 attention
    error = (got.float() - want).abs().max().item()
    assert error <= 1.5 * bf16_error(q, k, v, heads, scale) + 1e-3
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1 / 64)


@needs_kernel
def test_peaked_softmax_across_chunks_matches():
    """Scores spread wide (weights from 1 down to below bf16's range) and the largest one
    found late: the running maxima and rescaled sums of the chunks must still give the
    exact softmax."""
    q, k, v = operands(2, 700, 2, 72, seed=5, spread=3.0)
    k = k.clone()
    k[:, 650] = q[:, 3] * 4  # a late key far above the rest for query row 3
    scale = 72**-0.5
    got = kernel.vision_attention(q, k.contiguous(), v.contiguous(), 2, scale)
    want = reference(q, k, v, 2, scale)
    error = (got.float() - want).abs().max().item()
    assert error <= 1.5 * bf16_error(q, k, v, 2, scale) + 1e-3


@needs_kernel
@pytest.mark.parametrize("position", [300, 650])  # inside a full chunk, in the last one
# row 3's late score passes its running maximum by 2.4, 7.6, 8.6, 23 and 147 (log2 units)
@pytest.mark.parametrize("factor", [0.5, 0.625, 0.65, 1.0, 4.0])
def test_a_late_maximum_raised_by_any_margin_matches(position, factor):
    """The running maximum is kept until a score passes it by more than the kernel's
    headroom (weights up to 2^8): a late key whose score passes it by less, by about as
    much and by far more, in a full chunk and in the padded last one."""
    q, k, v = operands(1, 700, 2, 72, seed=11, spread=2.0)
    k = k.clone()
    k[:, position] = q[:, 3] * factor
    scale = 72**-0.5
    got = kernel.vision_attention(q, k.contiguous(), v.contiguous(), 2, scale)
    want = reference(q, k, v, 2, scale)
    assert torch.isfinite(got).all()
    error = (got.float() - want).abs().max().item()
    assert error <= 1.5 * bf16_error(q, k, v, 2, scale) + 1e-3


@needs_kernel
def test_images_do_not_see_each_other():
    q, k, v = operands(3, 40, 2, 72, seed=9)
    together = kernel.vision_attention(q, k, v, 2, 0.1)
    for i in range(3):
        alone = kernel.vision_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], 2, 0.1)
        assert torch.equal(alone[0], together[i])


@needs_kernel
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.float(), "k must be bf16"),
        (lambda t: t[:, :-1], "k has shape"),
        (lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "evenly spaced"),
        (lambda t: torch.cat([t, t], -1)[..., ::2], "evenly spaced"),  # channels apart
    ],
)
def test_bad_inputs_are_refused(change, message):
    q, k, v = (t.contiguous() for t in operands(2, 6, 2, 72, seed=1))
    with pytest.raises(ValueError, match=message):
        kernel.vision_attention(q, change(k), v, 2, 0.1)


@needs_kernel
def test_head_dim_beyond_the_limit_is_refused():
    width = native_library().limits.max_head_dim + 16
    q = torch.zeros(1, 3, width, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not take this shape"):
        kernel.vision_attention(q, q, q, 1, 0.1)


def test_this_cpu_gets_its_fastest_path(cpu_path):
    amx = kernel.available()
    cpu_path("vision tower attention (bf16)", "AMX tiles" if amx else "PyTorch sdpa")
    wanted = {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16"}
    if not wanted <= kernels.cpu_flags():
        assert not amx


def _siglip_attention(hidden=144, heads=2):
    config = VisionConfig(
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        image_size=28,
        patch_size=7,
    )
    torch.manual_seed(3)
    attention = SiglipAttention(config).eval()
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0, 0.2)
    return attention.bfloat16()


def test_siglip_attention_takes_the_kernel_where_it_runs(monkeypatch):
    """In bf16 the tower's attention goes to the kernel exactly where it runs, and either
    way gives PyTorch's attention to bf16 rounding."""
    attention = _siglip_attention()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 37, 144, generator=g).bfloat16()
    calls = []
    original = kernel.vision_attention
    monkeypatch.setattr(kernel, "vision_attention", lambda *a: calls.append(1) or original(*a))
    runs = int(kernel.available())
    with torch.no_grad():
        got = attention(x, residual=x)
        assert len(calls) == runs
        monkeypatch.setattr(kernel, "available", lambda: False)
        sdpa = attention(x, residual=x)
        assert len(calls) == runs  # no second call
        want = attention.float()(x.float(), residual=x.float())
    assert (got.float() - want).abs().max() <= 1.5 * (sdpa.float() - want).abs().max() + 1e-2


def test_a_build_without_amx_refuses_the_call(tmp_path):
    """What a CPU without AMX gets: the limits say so, the call is refused by name, and
    the towers keep PyTorch's attention."""
    variant = build_with(("-march=x86-64-v3",), tmp_path)
    assert not variant.limits.vision_attention_amx
    q, k, v = (t.contiguous() for t in operands(1, 8, 2, 72, seed=2))
    out = torch.empty_like(q)
    args = VisionAttentionArgs(
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        out=out.data_ptr(),
        num_images=1,
        seq_len=8,
        num_heads=2,
        head_dim=72,
        q_stride=144,
        k_stride=144,
        v_stride=144,
        scale=0.1,
        num_threads=1,
    )
    assert variant.lib.tm_vision_attention(ctypes.byref(args)) == UNSUPPORTED_ISA
