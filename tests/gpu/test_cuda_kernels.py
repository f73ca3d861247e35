"""The Triton attention and cache-store kernels on a real GPU, fp32 and bf16, against
float64 attention over the same cache (run with `pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import pytest
import torch
from paged_reference import mixed_step

from tokenmill.engine.cuda import triton_attention as ta

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "window", "tile_size"),
    [
        (9, 3, 64, 16, None, 32),  # SmolLM2, the engine's tile size
        (4, 1, 256, 16, 24, 16),  # Gemma 3 270M's shape, a sliding window
        (8, 2, 128, 32, None, 16),
        (4, 2, 80, 8, 5, 4),
    ],
)
def test_attention_matches_float64(
    dtype, num_heads, num_kv_heads, head_dim, block_size, window, tile_size
):
    step = mixed_step(
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tile_size=tile_size,
        decode_contexts=(1, 17, 300, 1000),
        chunks=((9, 9), (130, 700), (64, 64)),
        dtype=dtype,
        device="cuda",
    )
    out = ta.paged_attention(
        step.q, step.k_cache, step.v_cache, step.meta, step.scale, sliding_window=window
    )
    expected = step.reference(window)
    error = (out.double().cpu() - expected).abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_indexed_assignment(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, block_size = 300, 3, 64, 16
    k_cache = torch.zeros(40, num_kv_heads, head_dim, block_size, dtype=dtype, device="cuda")
    v_cache = torch.zeros(40, num_kv_heads, block_size, head_dim, dtype=dtype, device="cuda")
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to("cuda", dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(40 * block_size, generator=gen)[:num_tokens].cuda()
    blocks, offsets = slots // block_size, slots % block_size
    blocks[::7] = -1  # padding rows
    ta.store_kv(k, v, k_cache, v_cache, blocks, offsets)
    keep = blocks >= 0
    expected_k = torch.zeros_like(k_cache)
    expected_v = torch.zeros_like(v_cache)
    expected_k[blocks[keep], :, :, offsets[keep]] = k[keep]
    expected_v[blocks[keep], :, offsets[keep]] = v[keep]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
