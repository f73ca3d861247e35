"""Attention over the paged KV cache.

A step's tokens arrive flattened, with no padding: first one query token for each
decoding sequence, then the query chunks of the sequences still prefilling. Decoding
sequences are attended to in one batched call; each prefill chunk gets its own call,
reading its earlier context back from the cache when it has any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class PrefillSpan:
    """One sequence's chunk of query tokens in the flat batch."""

    start: int  # offset of the chunk's first token in the flat batch
    num_query_tokens: int
    num_context_tokens: int  # tokens attended to, this chunk included
    # Flat cache slots of all context tokens [num_context_tokens]; None when the chunk
    # is the whole context, so keys and values come straight from this step.
    context_slots: torch.Tensor | None
    # [num_query_tokens, num_context_tokens] bool, True = may attend; None when causal.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot to write each new k/v to
    num_decode_tokens: int  # the first num_decode_tokens tokens decode, one per sequence
    decode_context_slots: torch.Tensor | None  # [num_decodes, max_context] flat slots
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillSpan]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's keys/values into the cache, then attend.

    Args:
        q: [num_tokens, num_heads, head_dim]
        k, v: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache: [num_slots, num_kv_heads, head_dim] (blocks flattened)
    Returns:
        [num_tokens, num_heads, head_dim]
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    num_decodes = meta.num_decode_tokens
    if num_decodes:
        qd = q[:num_decodes].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_context_slots].transpose(1, 2)  # [B, Hkv, K, D]
        vd = v_cache[meta.decode_context_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:num_decodes] = od.squeeze(2)

    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_query_tokens)
        qp = q[rows].transpose(0, 1)  # [H, q, D]
        if span.context_slots is None:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            kp = k_cache[span.context_slots].transpose(0, 1)  # [Hkv, ctx, D]
            vp = v_cache[span.context_slots].transpose(0, 1)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=span.mask,
            is_causal=span.mask is None and span.num_query_tokens > 1,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = op.transpose(0, 1)
    return out
