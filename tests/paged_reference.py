"""A random paged KV cache, float64 attention over it, and the Triton kernels' metadata
for it: shared by the interpreter tests (tests/engine) and the GPU tests (tests/gpu)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.cuda import triton_attention as ta
from tokenmill.engine.worker.attention.portable import gather_key_blocks, gather_value_blocks


def paged_cache(num_kv_heads, head_dim, block_size, num_blocks=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, num_kv_heads, head_dim, block_size, generator=gen)
    v = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    return k, v, torch.randperm(num_blocks, generator=gen).tolist()


def reference_attention(q, k_cache, v_cache, seqs, scale, window):
    """seqs: (first row, num queries, context length, block table) each."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for first, num_queries, context, table in seqs:
        ids = torch.tensor([table])
        keys = gather_key_blocks(k_cache, ids)[0, :, :context].double()  # [kv, ctx, d]
        values = gather_value_blocks(v_cache, ids)[0, :, :context].double()
        keys = keys.repeat_interleave(group, 0)
        values = values.repeat_interleave(group, 0)
        query = q[first : first + num_queries].double().transpose(0, 1)  # [h, nq, d]
        scores = query @ keys.transpose(1, 2) * scale  # [h, nq, ctx]
        rows = torch.arange(context - num_queries, context)[:, None]
        cols = torch.arange(context)[None, :]
        visible = cols <= rows
        if window:
            visible &= cols > rows - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first : first + num_queries] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def triton_metadata(seqs, num_decodes, tile_size, width, device="cpu"):
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    for i, (_, _, _, table) in enumerate(seqs):
        tables[i, : len(table)] = table
    starts = np.cumsum([0] + [n for _, n, _, _ in seqs])
    tile_seqs, tile_queries = ta.chunk_tiles(
        [n for _, n, _, _ in seqs[num_decodes:]], num_decodes, tile_size
    )

    def put(array):
        return torch.as_tensor(np.asarray(array, dtype=np.int64), device=device)

    return ta.TritonAttention(
        query_starts=put(starts),
        seq_lens=put([c for _, _, c, _ in seqs]),
        block_tables=put(tables),
        num_decodes=num_decodes,
        tile_seqs=put(tile_seqs),
        tile_queries=put(tile_queries),
        tile_size=tile_size,
    )


@dataclass
class MixedStep:
    """One step's queries over a random cache: decodes of several lengths, then a
    whole-prompt chunk and a late chunk of a longer prompt."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seqs: list  # (first row, num queries, context, block table)
    meta: ta.TritonAttention
    scale: float

    def reference(self, window: int | None) -> torch.Tensor:
        """float64 attention, on the CPU."""
        return reference_attention(
            self.q.cpu().float(),
            self.k_cache.cpu().float(),
            self.v_cache.cpu().float(),
            self.seqs,
            self.scale,
            window,
        )


def mixed_step(
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    *,
    tile_size,
    decode_contexts=(1, 17, 40),
    chunks=((9, 9), (13, 30)),  # (new tokens, context incl. them)
    dtype=torch.float32,
    device="cpu",
) -> MixedStep:
    layout = [(1, c) for c in decode_contexts] + list(chunks)
    num_blocks = sum(-(-c // block_size) for _, c in layout) + 8
    k_cache, v_cache, free = paged_cache(num_kv_heads, head_dim, block_size, num_blocks)
    seqs, row = [], 0
    for num_new, context in layout:
        table = [free.pop() for _ in range(-(-context // block_size))]
        seqs.append((row, num_new, context, table))
        row += num_new
    width = max(len(s[3]) for s in seqs) + 1
    meta = triton_metadata(seqs, len(decode_contexts), tile_size, width, device)
    q = torch.randn(row, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    return MixedStep(
        q=q.to(device, dtype),
        k_cache=k_cache.to(device, dtype),
        v_cache=v_cache.to(device, dtype),
        seqs=seqs,
        meta=meta,
        scale=head_dim**-0.5,
    )
