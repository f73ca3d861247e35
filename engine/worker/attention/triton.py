"""The Triton backend (CUDA): paged attention and KV stores through the kernels in
`engine/cuda/`, reading the cache in place for decode tokens and prompt chunks alike, in
at most two launches per layer. Decode-only steps may be replayed from CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.core.step import SchedulerOutput
from tokenmill.engine.cuda import triton_attention as kernels
from tokenmill.engine.cuda import triton_available
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.worker.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    StepTokens,
    padded_block_tables,
    upload,
)


@dataclass
class TritonMetadata(StepAttention):
    slot_blocks: torch.Tensor  # [num_tokens] cache block of each new key and value (-1: none)
    slot_offsets: torch.Tensor  # [num_tokens] its offset in the block
    sequences: kernels.TritonAttention  # the step's sequences as the kernels take them

    def attend(self, q, k, v, k_cache, v_cache, scale, sliding_window=None, sinks=None):
        if sinks is not None:  # select_backend never hands it a model with sinks
            raise ValueError("the triton attention backend does not compute attention sinks")
        kernels.store_kv(k, v, k_cache, v_cache, self.slot_blocks, self.slot_offsets)
        return kernels.paged_attention(
            q, k_cache, v_cache, self.sequences, scale, sliding_window=sliding_window
        )


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cuda" or not triton_available():
            return "runs on CUDA devices with Triton installed"
        if not kernels.supports_block_size(spec.block_size):
            return f"needs a power-of-two block_size, not {spec.block_size}"
        return None

    def build(self, step: StepTokens, out: SchedulerOutput) -> TritonMetadata:
        """The step's sequences as the kernels take them: decodes, then prompt chunks cut
        into tiles."""
        device, bs = self.spec.device, self.spec.block_size
        num_queries = [c.num_new_tokens for c in out.chunks]
        seq_lens = [c.seq.num_computed_tokens + c.num_new_tokens for c in out.chunks]
        tile_size = kernels.prefill_tile_queries(self.spec.heads_per_kv_head, self.spec.head_dim)
        num_decodes = len(out.decodes)
        tile_seqs, tile_queries = kernels.chunk_tiles(
            num_queries[num_decodes:], num_decodes, tile_size
        )
        sequences = kernels.TritonAttention(
            query_starts=upload(np.cumsum([0, *num_queries]), device),
            seq_lens=upload(np.asarray(seq_lens), device),
            block_tables=padded_block_tables(step.tables, seq_lens, bs, device),
            num_decodes=num_decodes,
            tile_seqs=upload(tile_seqs, device),
            tile_queries=upload(tile_queries, device),
            tile_size=tile_size,
        )
        return TritonMetadata(
            slot_blocks=upload(step.slots // bs, device),
            slot_offsets=upload(step.slots % bs, device),
            sequences=sequences,
        )
