"""The CUDA attention kernels (Triton), run by Triton's interpreter on CPU tensors, against
float64 attention over copies gathered out of the paged cache: decodes and prompt chunks in
one step, GQA, head dims that are not powers of two, sliding windows, padding sequences.

The interpreter runs the same kernel code as the GPU in fp32 (its bf16 dots are not
emulated), so bf16 is checked on the device by tests/gpu/ and benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch
from paged_reference import mixed_step, paged_cache, reference_attention, triton_metadata

from tokenmill.engine.cuda import triton_attention as ta


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "window"),
    [
        (3, 1, 64, 16, None),  # SmolLM2's group of 3
        (4, 2, 80, 8, None),  # head_dim not a power of two, small blocks
        (4, 1, 32, 16, 7),  # sliding window smaller than a block
        (2, 2, 16, 4, 20),  # window spanning several blocks, no GQA
    ],
)
def test_decodes_and_prompt_chunks_match_float64(
    num_heads, num_kv_heads, head_dim, block_size, window
):
    step = mixed_step(num_heads, num_kv_heads, head_dim, block_size, tile_size=4)
    out = ta.paged_attention(
        step.q, step.k_cache, step.v_cache, step.meta, step.scale, sliding_window=window
    )
    expected = step.reference(window)
    assert torch.allclose(out.double(), expected, atol=2e-5, rtol=1e-5), (
        (out.double() - expected).abs().max()
    )


def test_padding_sequences_are_left_alone():
    """CUDA-graph batches pad with sequences of length 0; their rows are not written."""
    k_cache, v_cache, free = paged_cache(1, 16, 16)
    seqs = [(0, 1, 5, [free.pop()]), (1, 1, 0, [0])]
    meta = triton_metadata(seqs, 2, 1, 2)
    q = torch.randn(2, 2, 16)
    out = torch.full_like(q, 7.0)
    ta.paged_attention(q, k_cache, v_cache, meta, 0.25, out=out)
    assert torch.all(out[1] == 7.0)
    expected = reference_attention(q, k_cache, v_cache, seqs[:1], 0.25, None)
    assert torch.allclose(out[0].double(), expected[0], atol=2e-5)


def test_store_kv_writes_the_cache_layout_and_skips_padding():
    num_kv_heads, head_dim, block_size = 2, 24, 8
    k_cache = torch.zeros(6, num_kv_heads, head_dim, block_size)
    v_cache = torch.zeros(6, num_kv_heads, block_size, head_dim)
    qkv = torch.randn(4, 3 * num_kv_heads * head_dim)  # keys and values as strided views
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(4, 2, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(4, 2, head_dim)
    blocks = torch.tensor([3, 0, -1, 5])
    offsets = torch.tensor([7, 0, 4, 2])
    ta.store_kv(k, v, k_cache, v_cache, blocks, offsets)
    expected_k = torch.zeros_like(k_cache)
    expected_v = torch.zeros_like(v_cache)
    keep = blocks >= 0
    expected_k[blocks[keep], :, :, offsets[keep]] = k[keep]
    expected_v[blocks[keep], :, offsets[keep]] = v[keep]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_chunk_tiles_cover_every_query_token_once():
    seqs, firsts = ta.chunk_tiles([5, 1, 8], first_seq=2, tile_size=4)
    assert seqs.tolist() == [2, 2, 3, 4, 4]
    assert firsts.tolist() == [0, 4, 0, 0, 4]
