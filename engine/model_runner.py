"""Runs one scheduled step: flatten its chunks into one unpadded batch, run the
model, compute logits only where a token is sampled, and sample."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.engine.attention import AttentionMetadata, PrefillSpan
from tokenmill.engine.config import ModelConfig
from tokenmill.engine.host_memory import keep_large_allocations_mapped
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries,
    native_attention_fits,
    native_attention_supports,
)
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.layers import RotaryEmbedding
from tokenmill.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from tokenmill.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenmill.engine.shared_prefix import group_shared_prefixes

# Query rows (sequences x query heads per kv head) the native kernel attends to in one
# item when decoding sequences share prefix blocks: enough to read a shared prefix once
# for a large batch, few enough that its scores stay in L2 and both threads get work.
SHARED_PREFIX_ROWS = 96


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
        # Gemma 3's sliding-window layers rotate with a base of their own.
        self.local_rotary = None
        if config.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(config, max_model_len, device, local=True)
        self.sampler = Sampler(seed)
        self.kv_cache = kv_cache
        if device.type == "cpu":
            keep_large_allocations_mapped()
        self.native_attention = native_attention_supports(device, dtype) and native_attention_fits(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, block_size
        )
        for layer_idx, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = kv_cache.k[layer_idx]
            layer.self_attn.v_cache = kv_cache.v[layer_idx]

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, sampling: SamplingBatch | None) -> SamplerOutput | None:
        """Compute the step's tokens; return one sampled token per sampling chunk,
        in the order of out.chunks (None when no chunk samples)."""
        input_ids, positions, meta, sample_rows = self._prepare(out)
        cos, sin = self.rotary.lookup(positions, self.dtype)
        extra = {}
        if self.local_rotary is not None:
            extra["local_rope"] = self.local_rotary.lookup(positions, self.dtype)
        hidden = self.model(input_ids, cos, sin, meta, **extra)
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

        decode_tables = [add(chunk) for chunk in out.decodes]
        decode_lens = [chunk.seq.num_computed_tokens + 1 for chunk in out.decodes]
        prefill_tables = [add(chunk) for chunk in out.prefills]
        native = None
        prefills: list[PrefillSpan] = []
        if self.native_attention:
            native = self._attention_entries(
                out, offsets, decode_tables, decode_lens, prefill_tables
            )
        else:
            for chunk, table in zip(out.prefills, prefill_tables):
                start = chunk.seq.num_computed_tokens
                num_context = start + chunk.num_new_tokens
                # Earlier context is read back from the cache; a whole-prompt chunk
                # attends to its own keys and values directly.
                ids = self._tensor(table[: -(-num_context // bs)]) if start else None
                prefills.append(
                    PrefillSpan(offsets[id(chunk)], chunk.num_new_tokens, num_context, ids)
                )
        # Sampled rows in the order of out.chunks, whatever order the tokens went in.
        sample_rows = [offsets[id(c)] + c.num_new_tokens - 1 for c in out.chunks if c.samples]

        decode_block_tables = decode_context_lens = None
        if decode_tables and native is None:
            decode_block_tables = self._padded_block_tables(decode_tables, decode_lens)
            decode_context_lens = self._tensor(np.asarray(decode_lens))
        slot_mapping = np.concatenate(slots)
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_mapping // bs),
            slot_offsets=self._tensor(slot_mapping % bs),
            num_decode_tokens=len(decode_lens),
            block_size=bs,
            native=native,
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

    def _attention_entries(
        self,
        out: SchedulerOutput,
        offsets: dict[int, int],
        decode_tables: list[np.ndarray],
        decode_lens: list[int],
        prefill_tables: list[np.ndarray],
    ) -> AttentionEntries:
        """The step's tokens as the native kernel's entries: each prompt chunk alone, then
        the decoding sequences in groups that share prefix blocks, then the rest."""
        rows: list[int] = []
        queries: list[int] = []
        contexts: list[int] = []
        tables: list[np.ndarray] = []
        starts, shared = [0], []

        def add_group(members: list[tuple[ScheduledChunk, np.ndarray]], shared_blocks: int):
            for chunk, table in members:
                rows.append(offsets[id(chunk)])
                queries.append(chunk.num_new_tokens)
                contexts.append(chunk.seq.num_computed_tokens + chunk.num_new_tokens)
                tables.append(table)
            starts.append(len(rows))
            shared.append(shared_blocks)

        # Prompt chunks first: their tiles are the largest items, best started early.
        for chunk, table in zip(out.prefills, prefill_tables):
            add_group([(chunk, table)], 0)
        heads_per_kv = self.config.num_attention_heads // self.config.num_key_value_heads
        groups, alone = group_shared_prefixes(
            decode_tables, decode_lens, self.block_size, max(2, SHARED_PREFIX_ROWS // heads_per_kv)
        )
        for group in groups:
            members = [(out.decodes[i], decode_tables[i]) for i in group.members]
            add_group(members, group.shared_blocks)
        for i in alone:
            add_group([(out.decodes[i], decode_tables[i])], 0)
        return AttentionEntries(
            rows=self._tensor(np.asarray(rows)),
            queries=self._tensor(np.asarray(queries)),
            contexts=self._tensor(np.asarray(contexts)),
            block_tables=self._padded_block_tables(tables, contexts),
            group_starts=self._tensor(np.asarray(starts)),
            group_shared_blocks=self._tensor(np.asarray(shared)),
        )

    def _padded_block_tables(self, tables: list[np.ndarray], lengths: list[int]) -> torch.Tensor:
        """[len(tables), max_blocks] block ids, padded with block 0 to the blocks the
        longest of `lengths` (one per table) needs."""
        max_blocks = -(-max(lengths) // self.block_size)
        padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for row, table in enumerate(tables):
            n = min(len(table), max_blocks)
            padded[row, :n] = table[:n]
        return self._tensor(padded)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(
            self.device, non_blocking=True
        )
