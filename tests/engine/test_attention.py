"""Decode attention: the native kernel against the portable PyTorch path."""

from __future__ import annotations

import pytest
import torch

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
