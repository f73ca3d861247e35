"""Triton kernels over the paged KV cache (the cache layout is `engine.kv_cache.KVCache`'s:
keys [num_blocks, num_kv_heads, head_dim, block_size], values [num_blocks, num_kv_heads,
block_size, head_dim]). Imported only where Triton is installed; `triton_attention` wraps
them for torch tensors.

Attention: one program per (tile, kv head). A tile is up to BLOCK_Q query tokens of one
sequence; its rows are those tokens times the kv head's query heads, so every key and value
read from the cache serves all of them (GQA without copies). The program walks the
sequence's blocks BLOCK_N positions at a time (several cache blocks per step, gathered
through the block table) with an online softmax, from the first position its first row
may see to the last its last row may see. Within that range a row sees position n when
n <= its own position and, with a sliding window W, n > its position - W.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_blocks_ptr,
    slot_offsets_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_head,
    stride_vc_slot,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (token, kv head) per program: its key and value into their cache slot. A
    negative block id marks a padding token (CUDA-graph batches), which stores nothing."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(slot_blocks_ptr + token)
    if block >= 0:
        offset = tl.load(slot_offsets_ptr + token)
        d = tl.arange(0, BLOCK_D)
        in_dim = d < HEAD_DIM
        key = tl.load(k_ptr + token * stride_k_token + head * stride_k_head + d, mask=in_dim)
        k_dst = k_cache_ptr + block * stride_kc_block + head * stride_kc_head
        tl.store(k_dst + d * stride_kc_dim + offset, key, mask=in_dim)
        value = tl.load(v_ptr + token * stride_v_token + head * stride_v_head + d, mask=in_dim)
        v_dst = v_cache_ptr + block * stride_vc_block + head * stride_vc_head
        tl.store(v_dst + offset * stride_vc_slot + d, value, mask=in_dim)


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_starts_ptr,  # [num_seqs + 1] a sequence's query tokens: rows [starts[i], starts[i+1])
    seq_lens_ptr,  # [num_seqs] positions its last query token sees, itself included
    block_tables_ptr,  # [num_seqs, max_blocks]
    tile_seqs_ptr,  # [num_tiles] the tile's sequence (unused when ONE_TILE_PER_SEQ)
    tile_queries_ptr,  # [num_tiles] the tile's first query token within its sequence
    scale_log2,  # softmax scale * log2(e): scores are exponentiated with exp2
    sliding_window,  # 0: every earlier position is visible
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_kc_block,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_head,
    stride_vc_slot,
    stride_table,
    HEADS_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,  # power of two >= BLOCK_Q * HEADS_PER_KV (and >= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # positions per step, a multiple of BLOCK_SIZE
    ONE_TILE_PER_SEQ: tl.constexpr,  # decode: tile i is sequence i's single query token
    IEEE_DOT: tl.constexpr,  # fp32 caches: full-precision dots, not TF32
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ONE_TILE_PER_SEQ:
        seq = tile
        first_query = 0
    else:
        seq = tl.load(tile_seqs_ptr + tile)
        first_query = tl.load(tile_queries_ptr + tile)
    seq_len = tl.load(seq_lens_ptr + seq)
    query_start = tl.load(query_starts_ptr + seq)
    num_queries = tl.load(query_starts_ptr + seq + 1) - query_start
    if seq_len > 0:  # a padding sequence (CUDA-graph batches) has none
        context_start = seq_len - num_queries  # position of the sequence's first query token

        rows = tl.arange(0, ROWS)
        row_query = first_query + rows // HEADS_PER_KV  # query token within the sequence
        head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
        is_row = (rows < BLOCK_Q * HEADS_PER_KV) & (row_query < num_queries)
        row_pos = context_start + row_query
        d = tl.arange(0, BLOCK_D)
        in_dim = d < HEAD_DIM
        q_rows = (query_start + row_query)[:, None] * stride_q_token
        q = tl.load(
            q_ptr + q_rows + head[:, None] * stride_q_head + d[None, :],
            mask=is_row[:, None] & in_dim[None, :],
            other=0.0,
        )  # [ROWS, BLOCK_D]

        last_query = tl.minimum(first_query + BLOCK_Q, num_queries) - 1
        end = context_start + last_query + 1  # past the last position any row sees
        # With a window, the first row sees nothing before its position - window + 1.
        window_start = tl.maximum(context_start + first_query - sliding_window + 1, 0)
        start = tl.where(sliding_window > 0, (window_start // BLOCK_SIZE) * BLOCK_SIZE, 0)

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq * stride_table
        k_base = k_cache_ptr + kv_head * stride_kc_head
        v_base = v_cache_ptr + kv_head * stride_vc_head
        # A while loop, not range(): Triton's interpreter cannot take loaded bounds there.
        first_pos = start
        while first_pos < end:
            pos = first_pos + tl.arange(0, BLOCK_N)
            in_range = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=in_range, other=0)
            slot = pos % BLOCK_SIZE
            k = tl.load(
                k_base
                + block[None, :] * stride_kc_block
                + d[:, None] * stride_kc_dim
                + slot[None, :],
                mask=in_dim[:, None] & in_range[None, :],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            if IEEE_DOT:
                scores = tl.dot(q, k, input_precision="ieee")
            else:
                scores = tl.dot(q, k)
            scores = scores * scale_log2  # [ROWS, BLOCK_N]
            visible = (pos[None, :] <= row_pos[:, None]) & in_range[None, :]
            in_window = (sliding_window == 0) | (pos[None, :] > row_pos[:, None] - sliding_window)
            visible = visible & in_window
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen nothing yet keeps m = -inf; exponentiate against 0 instead.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base
                + block[:, None] * stride_vc_block
                + slot[:, None] * stride_vc_slot
                + d[None, :],
                mask=in_range[:, None] & in_dim[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            first_pos += BLOCK_N

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (query_start + row_query)[:, None] * stride_o_token
        tl.store(
            out_ptr + o_rows + head[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=is_row[:, None] & in_dim[None, :],
        )
