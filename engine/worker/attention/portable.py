"""The portable backend: attention over the paged KV cache in PyTorch ops, for any device
and dtype (the fallback where no kernel backend applies: other dtypes or devices, no C
compiler, no Triton, an attention shape the kernels do not take).

Decoding sequences are attended to in one batched SDPA over gathered copies of their
context, and each prefill chunk gets its own call, reading its earlier context back
from the cache when it has any. Its bf16/fp16 chunks on CPU are two batched matmuls
around the softmax rather than SDPA, whose fused CPU kernel keeps its tiles in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from tokenmill.engine.core.step import SchedulerOutput
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.worker.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    StepTokens,
    padded_block_tables,
    upload,
)


@dataclass
class PrefillSpan:
    """One sequence's chunk of query tokens in the flat batch."""

    start: int  # offset of the chunk's first token in the flat batch
    num_query_tokens: int
    num_context_tokens: int  # tokens attended to, this chunk included
    # Cache blocks holding the whole context, in order [num_context_blocks]; None when
    # the chunk is the whole context, so keys and values come straight from this step.
    context_block_ids: torch.Tensor | None


@dataclass
class PortableMetadata(StepAttention):
    # Where each new token's key and value go: cache block and offset in it [num_tokens].
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decode_tokens: int  # the first num_decode_tokens tokens decode, one per sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[PrefillSpan]

    def attend(self, q, k, v, k_cache, v_cache, scale, sliding_window=None, sinks=None):
        if sinks is not None:  # select_backend never hands it a model with sinks
            raise ValueError("the portable attention backend does not compute attention sinks")
        k_cache[self.slot_blocks, :, :, self.slot_offsets] = k
        v_cache[self.slot_blocks, :, self.slot_offsets] = v
        out = torch.empty_like(q)
        num_decodes = self.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = _decode_attention(
                q[:num_decodes], k_cache, v_cache, self, scale, sliding_window
            )
        for span in self.prefills:
            out[span.start : span.start + span.num_query_tokens] = _prefill_span_attention(
                q, k, v, k_cache, v_cache, span, scale, sliding_window
            )
        return out


class PortableBackend(AttentionBackend):
    name = "portable"

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        return None  # PyTorch ops serve every device, dtype and shape

    def build(self, step: StepTokens, out: SchedulerOutput) -> PortableMetadata:
        device, bs = self.spec.device, self.spec.block_size
        num_decodes = len(out.decodes)
        decode_tables, prefill_tables = step.tables[:num_decodes], step.tables[num_decodes:]
        prefills = []
        for chunk, table in zip(out.prefills, prefill_tables):
            start = chunk.seq.num_computed_tokens
            num_context = start + chunk.num_new_tokens
            # Earlier context is read back from the cache; a whole-prompt chunk attends to
            # its own keys and values directly.
            ids = upload(table[: -(-num_context // bs)], device) if start else None
            prefills.append(
                PrefillSpan(step.offsets[id(chunk)], chunk.num_new_tokens, num_context, ids)
            )
        decode_tables_padded = decode_lens = None
        if decode_tables:
            lens = [chunk.seq.num_computed_tokens + 1 for chunk in out.decodes]
            decode_tables_padded = padded_block_tables(decode_tables, lens, bs, device)
            decode_lens = upload(np.asarray(lens), device)
        return PortableMetadata(
            slot_blocks=upload(step.slots // bs, device),
            slot_offsets=upload(step.slots % bs, device),
            num_decode_tokens=num_decodes,
            decode_block_tables=decode_tables_padded,
            decode_context_lens=decode_lens,
            prefills=prefills,
        )


def _prefill_span_attention(
    q, k, v, k_cache, v_cache, span: PrefillSpan, scale: float, sliding_window: int | None = None
):
    """One prefill chunk -> [num_query_tokens, num_heads, head_dim]."""
    rows = slice(span.start, span.start + span.num_query_tokens)
    num_cached = span.num_context_tokens - span.num_query_tokens
    # 4-D [1, heads, tokens, head_dim] operands: with 3-D ones PyTorch's CPU
    # dispatcher drops to the unfused math kernel.
    qp = q[rows].transpose(0, 1)[None]
    if span.context_block_ids is None:
        kp, vp = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
    else:
        ids = span.context_block_ids[None]
        kp = gather_key_blocks(k_cache, ids)[:, :, : span.num_context_tokens]
        vp = gather_value_blocks(v_cache, ids)[:, :, : span.num_context_tokens]
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        op = prefill_attention_by_matmul(qp[0], kp[0], vp[0], num_cached, scale, sliding_window)
        return op.transpose(0, 1)
    mask = None
    if num_cached or sliding_window:  # query token i sits at position num_cached + i
        positions = torch.arange(span.num_context_tokens, device=q.device)
        mask = visible_positions(positions[num_cached:], positions, sliding_window)
    op = F.scaled_dot_product_attention(
        qp,
        kp,
        vp,
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None and span.num_query_tokens > 1,
        scale=scale,
        enable_gqa=True,
    )
    return op[0].transpose(0, 1)


# Query rows per tile: causal tiles skip the context columns after their last row, and
# only a tile's diagonal block needs masking; bounded again by SCORES_TILE_BYTES so a long
# context's scores never need gigabytes.
QUERY_TILE = 128
SCORES_TILE_BYTES = 16 << 20


def visible_positions(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[num_queries, num_keys] bool: which keys each query sees - those at or before its
    own position, and within its window when there is one."""
    offsets = query_positions[:, None] - key_positions[None, :]  # how far back the key is
    allowed = offsets >= 0
    if sliding_window:
        allowed &= offsets < sliding_window
    return allowed


def prefill_attention_by_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_cached: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for one prefill chunk as batched matmuls. The query heads of each
    kv head are stacked into one operand, so GQA needs no copies of k and v.

    Query token i (of the chunk) sits at position num_cached + i and sees context
    positions 0..num_cached + i, or only the last sliding_window of them.

    Args:
        q: [num_heads, num_query_tokens, head_dim]
        k, v: [num_kv_heads, num_cached + num_query_tokens, head_dim]
        num_cached: context tokens before the chunk (read back from the cache).
        sliding_window: see `StepAttention.attend`.
    Returns:
        [num_heads, num_query_tokens, head_dim]
    """
    num_heads, num_query, dim = q.shape
    num_kv_heads, num_context, _ = k.shape
    group = num_heads // num_kv_heads
    q4 = q.reshape(num_kv_heads, group, num_query, dim)
    k_t = k.transpose(1, 2)
    out = torch.empty(num_kv_heads, group, num_query, dim, dtype=q.dtype, device=q.device)
    tile = max(1, min(QUERY_TILE, SCORES_TILE_BYTES // (4 * num_heads * num_context)))
    for first in range(0, num_query, tile):
        last = min(num_query, first + tile)
        rows = last - first
        visible = num_cached + last  # the tile's last row sees this many positions
        # A window hides the columns before the tile's first row's window.
        start = max(0, num_cached + first - sliding_window + 1) if sliding_window else 0
        width = visible - start
        # Scaling q (rows x dim) is cheaper than scaling the scores (rows x context).
        q_tile = (q4[:, :, first:last] * scale).reshape(num_kv_heads, group * rows, dim)
        scores = torch.bmm(q_tile, k_t[:, :, start:visible]).view(num_kv_heads, group, rows, width)
        if sliding_window:  # rows see different ranges of the columns: mask each
            row_positions = torch.arange(num_cached + first, visible, device=q.device)
            key_positions = torch.arange(start, visible, device=q.device)
            hidden = ~visible_positions(row_positions, key_positions, sliding_window)
            scores.masked_fill_(hidden, float("-inf"))
        elif rows > 1:  # row r of the tile may not see the r+1.. columns of its diagonal
            diagonal = scores[..., visible - rows :]
            future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
            diagonal.masked_fill_(future, float("-inf"))
        # CPU softmax accumulates reduced-precision input in fp32 and rounds once on
        # output: bit-identical to softmax(dtype=float32).to(bf16), one pass fewer.
        probs = torch.softmax(scores, dim=-1)
        out[:, :, first:last] = torch.bmm(
            probs.view(num_kv_heads, group * rows, width), v[:, start:visible]
        ).view(num_kv_heads, group, rows, dim)
    return out.view(num_heads, num_query, dim)


def _decode_attention(
    q, k_cache, v_cache, meta: PortableMetadata, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """q: [B, H, D] one token per sequence -> [B, H, D]: copy the context
    out block by block, then one batched SDPA that masks the padding past each
    sequence's length (and the positions before its window)."""
    kd = gather_key_blocks(k_cache, meta.decode_block_tables)
    vd = gather_value_blocks(v_cache, meta.decode_block_tables)
    # Each sequence's token sits at position length - 1: the padding past it is hidden
    # like any later position.
    positions = torch.arange(kd.shape[2], device=q.device)
    mask = visible_positions(meta.decode_context_lens - 1, positions, sliding_window)
    mask = mask[:, None, None, :]
    od = F.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return od.squeeze(2)


def gather_key_blocks(k_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Copy whole key blocks out of the cache, back in token-major order.

    Args:
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size]
        block_tables: [num_seqs, max_blocks] block ids
    Returns:
        [num_seqs, num_kv_heads, max_blocks * block_size, head_dim]
    """
    num_seqs, max_blocks = block_tables.shape
    _, heads, dim, block_size = k_cache.shape
    blocks = k_cache.index_select(0, block_tables.reshape(-1))
    blocks = blocks.view(num_seqs, max_blocks, heads, dim, block_size).permute(0, 2, 1, 4, 3)
    return blocks.reshape(num_seqs, heads, max_blocks * block_size, dim)


def gather_value_blocks(v_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Copy whole value blocks out of the cache, head-major.

    Args:
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: [num_seqs, max_blocks] block ids
    Returns:
        [num_seqs, num_kv_heads, max_blocks * block_size, head_dim]
    """
    num_seqs, max_blocks = block_tables.shape
    _, heads, block_size, dim = v_cache.shape
    blocks = v_cache.index_select(0, block_tables.reshape(-1))
    blocks = blocks.view(num_seqs, max_blocks, heads, block_size, dim).transpose(1, 2)
    return blocks.reshape(num_seqs, heads, max_blocks * block_size, dim)
