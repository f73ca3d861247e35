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


@pytest.mark.parametrize(
    ("query_tile", "tile_bytes"), [(128, 16 << 20), (5, 16 << 20), (128, 2048)]
)
@pytest.mark.parametrize("num_cached", [0, 17])
def test_prefill_by_matmul_matches_fp32_sdpa(monkeypatch, query_tile, tile_bytes, num_cached):
    """bf16 prefill chunks: causal over the chunk, after num_cached cached tokens, in one
    tile or in many (each skipping the columns after its last row)."""
    monkeypatch.setattr(attention, "QUERY_TILE", query_tile)
    monkeypatch.setattr(attention, "SCORES_TILE_BYTES", tile_bytes)
    torch.manual_seed(1)
    num_kv_heads, group, head_dim, num_query = 2, 3, 16, 23
    num_context = num_cached + num_query
    q = torch.randn(num_kv_heads * group, num_query, head_dim)
    k = torch.randn(num_kv_heads, num_context, head_dim)
    v = torch.randn(num_kv_heads, num_context, head_dim)
    positions = torch.arange(num_cached, num_context)[:, None]
    allowed = torch.arange(num_context)[None, :] <= positions

    def sdpa(mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask[None, None], scale=0.25, enable_gqa=True
        )[0]

    got = attention.prefill_attention_by_matmul(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), num_cached, 0.25
    ).float()
    torch.testing.assert_close(got, sdpa(allowed), atol=3e-2, rtol=3e-2)
    # A mask one position off (each query seeing one future token) is far outside that
    # tolerance, so the comparison would catch an off-by-one in the tiles' masking.
    one_ahead = torch.arange(num_context)[None, :] <= positions + 1
    assert (got - sdpa(one_ahead)).abs().max() > 0.3
