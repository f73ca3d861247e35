"""Decode attention: the native kernel against the portable PyTorch path."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine import attention
from tokenmill.engine.attention import gather_key_blocks, gather_value_blocks
from tokenmill.engine.kernels import paged_attention_library, paged_decode_attention


def reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    k = gather_key_blocks(k_cache, tables).float()
    v = gather_value_blocks(v_cache, tables).float()
    mask = torch.arange(k.shape[2])[None, :] < lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(2),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_kernel_matches_pytorch(dtype, atol):
    if paged_attention_library() is None:
        pytest.fail("the native kernel did not build; is a C compiler installed?")
    torch.manual_seed(0)
    block_size, num_blocks, num_kv_heads, group, head_dim = 4, 64, 3, 3, 32
    k_cache = torch.randn(num_blocks, num_kv_heads, head_dim, block_size).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    lens = torch.tensor([1, 5, 16, 37, 60])
    tables = torch.zeros(len(lens), 15, dtype=torch.int64)
    perm = torch.randperm(num_blocks)
    used = 0
    for row, n in enumerate(lens.tolist()):  # scattered, non-contiguous blocks
        blocks = -(-n // block_size)
        tables[row, :blocks] = perm[used : used + blocks]
        used += blocks
    q = torch.randn(len(lens), num_kv_heads * group, head_dim).to(dtype)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, 0.17)
    want = reference(q, k_cache, v_cache, tables, lens, block_size, 0.17)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("tile_bytes", [16 << 20, 2048])  # one tile; many small tiles
@pytest.mark.parametrize("cached", [False, True])
def test_prefill_by_matmul_matches_fp32_sdpa(monkeypatch, tile_bytes, cached):
    """bf16 prefill chunks: causal over the chunk, or after cached context."""
    monkeypatch.setattr(attention, "SCORES_TILE_BYTES", tile_bytes)
    torch.manual_seed(1)
    num_kv_heads, group, head_dim, num_query = 2, 3, 16, 23
    num_context = num_query + (17 if cached else 0)
    q = torch.randn(num_kv_heads * group, num_query, head_dim)
    k = torch.randn(num_kv_heads, num_context, head_dim)
    v = torch.randn(num_kv_heads, num_context, head_dim)
    first = num_context - num_query
    allowed = torch.arange(num_context)[None, :] <= torch.arange(first, num_context)[:, None]
    span = attention.PrefillSpan(
        start=0,
        num_query_tokens=num_query,
        num_context_tokens=num_context,
        context_block_ids=torch.zeros(1, dtype=torch.int64) if cached else None,
        mask=allowed if cached else None,
    )
    got = attention.prefill_attention_by_matmul(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), span.blocked_positions(q.device), 0.25
    )
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=allowed[None, None], scale=0.25, enable_gqa=True
    )[0]
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    # A wrong mask (attending to the future) is far outside that tolerance.
    leaked = attention.prefill_attention_by_matmul(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.25
    )
    assert (leaked.float() - want).abs().max() > 0.3
