"""Paged attention and KV-cache stores on CUDA, through the Triton kernels in
`triton_kernels`: the cache is read in place through each sequence's block table, with no
gathered copies, for decode tokens and prompt chunks alike.

A step's sequences come in flat-batch order, decoding sequences (one query token each)
first. They are attended to in at most two launches per layer: one program per decoding
sequence and kv head, and one per prompt-chunk tile and kv head. The decode launch has a
fixed shape for a given number of sequences, which is what a CUDA graph captures.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

# Rows (query tokens x query heads of one kv head) of a prompt-chunk tile: enough that
# each key block read serves many rows, few enough that the fp32 accumulator stays in
# registers (halved for head_dim 256).
_PREFILL_ROWS = 128
_LOG2_E = 1.4426950408889634


@functools.cache
def _kernels():
    # Imported on first use: Triton is only needed where a CUDA device is (or, in the
    # tests, under TRITON_INTERPRET=1).
    from tokenmill.engine.cuda import triton_kernels

    return triton_kernels


def supports_block_size(block_size: int) -> bool:
    """The kernels index positions with power-of-two aranges."""
    return block_size >= 1 and block_size & (block_size - 1) == 0


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, math.floor(math.log2(max(n, 1))))


def prefill_tile_queries(heads_per_kv: int, head_dim: int) -> int:
    """Query tokens per prompt-chunk tile for a model's attention shape."""
    rows = _PREFILL_ROWS if head_dim <= 128 else _PREFILL_ROWS // 2
    return _pow2_at_most(max(1, rows // heads_per_kv))


@dataclass
class TritonAttention:
    """A step's sequences as the Triton kernels take them (built once per step, shared
    by every layer). Sequences [0, num_decodes) decode one token each."""

    query_starts: torch.Tensor  # [num_seqs + 1] int64, rows of each sequence's query tokens
    seq_lens: torch.Tensor  # [num_seqs] int64, positions its last query token sees (0: padding)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0
    num_decodes: int
    # Tiles of the prompt chunks (sequences num_decodes..): sequence and first query token.
    tile_seqs: torch.Tensor | None = None  # [num_tiles] int64
    tile_queries: torch.Tensor | None = None  # [num_tiles] int64
    tile_size: int = 1  # query tokens per prompt-chunk tile


def chunk_tiles(
    num_queries: list[int], first_seq: int, tile_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seqs, tile_queries): each chunk of num_queries[i] tokens (sequence
    first_seq + i) cut into tiles of tile_size query tokens."""
    counts = [-(-n // tile_size) for n in num_queries]
    seqs = np.repeat(np.arange(first_seq, first_seq + len(num_queries)), counts)
    starts = np.concatenate([np.arange(c) * tile_size for c in counts]) if counts else []
    return seqs.astype(np.int64), np.asarray(starts, dtype=np.int64)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store each token's key and value in its cache slot (a negative block: skipped).

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided views)
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
        slot_blocks, slot_offsets: [num_tokens] int64
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _kernels().store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_blocks,
        slot_offsets,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2_at_least(head_dim)),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonAttention,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every query token of a step, straight over the paged cache; the
    step's own keys and values must already be stored.

    Args:
        q: [num_tokens, num_heads, head_dim]
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size], q's dtype
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
        sliding_window: a query at position p sees positions > p - window; None = all.
        out: where to write (default: a new tensor like q).
    Returns:
        [num_tokens, num_heads, head_dim]
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = v_cache.shape
    heads_per_kv = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    common = dict(
        scale_log2=scale * _LOG2_E,
        sliding_window=int(sliding_window or 0),
        stride_q_token=q.stride(0),
        stride_q_head=q.stride(1),
        stride_o_token=out.stride(0),
        stride_o_head=out.stride(1),
        stride_kc_block=k_cache.stride(0),
        stride_kc_head=k_cache.stride(1),
        stride_kc_dim=k_cache.stride(2),
        stride_vc_block=v_cache.stride(0),
        stride_vc_head=v_cache.stride(1),
        stride_vc_slot=v_cache.stride(2),
        stride_table=meta.block_tables.stride(0),
        HEADS_PER_KV=heads_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2_at_least(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=max(64, block_size),
        IEEE_DOT=q.dtype == torch.float32,
    )
    tensors = (q, k_cache, v_cache, out, meta.query_starts, meta.seq_lens, meta.block_tables)
    kernel = _kernels().paged_attention_kernel
    if meta.num_decodes:
        kernel[(meta.num_decodes, num_kv_heads)](
            *tensors,
            meta.seq_lens,  # tile arrays unused for one tile per sequence
            meta.seq_lens,
            BLOCK_Q=1,
            ROWS=max(16, _pow2_at_least(heads_per_kv)),
            ONE_TILE_PER_SEQ=True,
            **common,
        )
    if meta.tile_seqs is not None and meta.tile_seqs.numel():
        kernel[(meta.tile_seqs.numel(), num_kv_heads)](
            *tensors,
            meta.tile_seqs,
            meta.tile_queries,
            BLOCK_Q=meta.tile_size,
            ROWS=max(16, _pow2_at_least(meta.tile_size * heads_per_kv)),
            ONE_TILE_PER_SEQ=False,
            **common,
        )
    return out
