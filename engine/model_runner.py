"""Runs one scheduled step: flatten its chunks into one unpadded batch, run the
model, compute logits only where a token is sampled, and sample."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.engine.attention import AttentionMetadata, PrefillSpan
from tokenmill.engine.config import ModelConfig
from tokenmill.engine.host_memory import keep_large_allocations_mapped
from tokenmill.engine.kernels import decode_kernel_supports
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.layers import RotaryEmbedding
from tokenmill.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from tokenmill.engine.scheduler import ScheduledChunk, SchedulerOutput

# Prefill chunks up to this many tokens are attended by the decode kernel, one row per
# token. Short prompts (classification rows, chat turns) are dominated by a per-call
# cost of SDPA that the kernel does not pay; longer chunks are better served by
# SDPA's or the matmul path's arithmetic intensity.
SHORT_PREFILL = 32


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        kv_cache: KVCache,
        *,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.rotary = RotaryEmbedding(config, max_model_len, device)
        self.sampler = Sampler(seed)
        self.kv_cache = kv_cache
        if device.type == "cpu":
            keep_large_allocations_mapped()
        # Without the native kernel, decode rows are gathered and padded to the longest
        # context, which would make folding short prefills into them a loss.
        self.fold_short_prefills = decode_kernel_supports(device, dtype)
        for layer_idx, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = kv_cache.k[layer_idx]
            layer.self_attn.v_cache = kv_cache.v[layer_idx]

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, sampling: SamplingBatch | None) -> SamplerOutput | None:
        """Compute the step's tokens; return one sampled token per sampling chunk,
        in the order of out.chunks (None when no chunk samples)."""
        input_ids, positions, meta, sample_rows = self._prepare(out)
        cos, sin = self.rotary.lookup(positions, self.dtype)
        hidden = self.model(input_ids, cos, sin, meta)
        if not sample_rows:
            return None
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return self.sampler(logits, sampling)

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        offsets: dict[int, int] = {}  # id(chunk) -> its first token's row in the batch
        prefills: list[PrefillSpan] = []

        def add(chunk: ScheduledChunk) -> np.ndarray:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            offsets[id(chunk)] = len(token_ids)
            token_ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            return table

        # Rows the decode kernel attends: one per decoding sequence, then every token
        # of the short prefill chunks (a chunk's token i sees the context up to itself,
        # which is exactly causal attention), so a step of many short prompts is one
        # kernel call per layer instead of one SDPA call per prompt per layer.
        decode_tables: list[np.ndarray] = []  # one per chunk, repeated per row below
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        for chunk in out.decodes:
            decode_tables.append(add(chunk))
            decode_rows.append(1)
            decode_lens.append(chunk.seq.num_computed_tokens + 1)
        fold = self.fold_short_prefills
        short_chunks = [c for c in out.prefills if fold and c.num_new_tokens <= SHORT_PREFILL]
        long_chunks = [c for c in out.prefills if not fold or c.num_new_tokens > SHORT_PREFILL]
        for chunk in short_chunks:
            decode_tables.append(add(chunk))
            decode_rows.append(chunk.num_new_tokens)
            start = chunk.seq.num_computed_tokens
            decode_lens.extend(range(start + 1, start + chunk.num_new_tokens + 1))
        for chunk in long_chunks:
            table = add(chunk)
            offset = offsets[id(chunk)]
            start = chunk.seq.num_computed_tokens
            num_query = chunk.num_new_tokens
            num_context = start + num_query
            context_block_ids = mask = None
            if start > 0:
                context_block_ids = self._tensor(table[: -(-num_context // bs)])
                q_pos = torch.arange(start, num_context)[:, None]
                mask = (torch.arange(num_context)[None, :] <= q_pos).to(self.device)
            prefills.append(PrefillSpan(offset, num_query, num_context, context_block_ids, mask))
        # Sampled rows in the order of out.chunks, whatever order the tokens went in.
        sample_rows = [offsets[id(c)] + c.num_new_tokens - 1 for c in out.chunks if c.samples]

        decode_block_tables = decode_context_lens = None
        if decode_tables:
            decode_block_tables = self._padded_block_tables(decode_tables, decode_rows, decode_lens)
            decode_context_lens = self._tensor(np.asarray(decode_lens))
        slot_mapping = np.concatenate(slots)
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_mapping // bs),
            slot_offsets=self._tensor(slot_mapping % bs),
            num_decode_tokens=len(decode_lens),
            block_size=bs,
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            prefills=prefills,
        )
        return (
            self._tensor(np.asarray(token_ids)),
            self._tensor(np.concatenate(positions)),
            meta,
            sample_rows,
        )

    def _padded_block_tables(
        self, tables: list[np.ndarray], rows: list[int], lengths: list[int]
    ) -> torch.Tensor:
        """[sum(rows), max_blocks] block ids: tables[i] repeated rows[i] times, padded
        with block 0 to the blocks the longest of `lengths` (one per row) needs."""
        max_blocks = -(-max(lengths) // self.block_size)
        padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for row, table in enumerate(tables):
            n = min(len(table), max_blocks)
            padded[row, :n] = table[:n]
        return self._tensor(np.repeat(padded, rows, axis=0))

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(
            self.device, non_blocking=True
        )
