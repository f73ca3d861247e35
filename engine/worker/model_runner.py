"""Runs one scheduled step: flatten its chunks into one unpadded batch, run the
model, compute logits only where a token is sampled (and at the prompt rows of
requests that asked for prompt log-probabilities), and sample.

Attention takes one of three paths, chosen once per model: the native C kernel (CPU, fp32
and bf16), the Triton kernels (CUDA), or the portable PyTorch path (anything else). On
CUDA, decode-only steps replay a CUDA graph (`engine.cuda.decode_graphs`), and a step's
inputs go up from pinned memory without waiting for the device, so the host can prepare
step N+1 while step N runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.core.step import SamplerOutput, ScheduledChunk, SchedulerOutput, StepResult
from tokenmill.engine.cuda import uses_triton
from tokenmill.engine.grammar import TokenBitmask
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries,
    native_attention_fits,
    native_attention_supports,
)
from tokenmill.engine.models.layers import RotaryEmbedding
from tokenmill.engine.worker import prompt_logprobs
from tokenmill.engine.worker.attention.portable import AttentionMetadata, PrefillSpan
from tokenmill.engine.worker.attention.shared_prefix import group_shared_prefixes
from tokenmill.engine.worker.host_memory import keep_large_allocations_mapped
from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.engine.worker.sampler import Sampler, SamplingBatch

if TYPE_CHECKING:
    from tokenmill.engine.core.step import PendingStep
    from tokenmill.engine.cuda.triton_attention import TritonAttention

# Query rows (sequences x query heads per kv head) the native kernel attends to in one
# item when decoding sequences share prefix blocks: enough to read a shared prefix once
# for a large batch, few enough that its scores stay in L2 and both threads get work.
SHARED_PREFIX_ROWS = 96


@dataclass
class StepTokens:
    """A step's tokens on the host, flattened chunk by chunk (decodes first)."""

    token_ids: np.ndarray  # [num_tokens] int64; placeholders where a sample is pending
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens] cache slot: block id * block_size + offset
    offsets: dict[int, int]  # id(chunk) -> the row of its first token
    tables: list[list[int]]  # each chunk's block table (the sequence's own list), in order
    sample_rows: list[int]  # rows whose logits are sampled, in the order of out.chunks
    placeholder_rows: list[int]  # rows holding a pending sample ...
    previous_rows: list[int]  # ... and that sample's row in the previous step


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
        max_num_seqs: int = 256,
        cuda_graphs: bool | None = None,
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
        self.sampler = Sampler(seed, device)
        self.kv_cache = kv_cache
        if device.type == "cpu":
            keep_large_allocations_mapped()
        self.attention_backend = self._attention_backend()
        if kv_cache.k.dtype == torch.int8 and self.attention_backend != "native":
            raise ValueError("an int8 KV cache is read only by the native attention kernel")
        for layer_idx, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = kv_cache.k[layer_idx]
            layer.self_attn.v_cache = kv_cache.v[layer_idx]
        self.decode_graphs = None
        if cuda_graphs or (cuda_graphs is None and self.attention_backend == "triton"):
            if self.attention_backend != "triton":
                raise ValueError("cuda_graphs needs a CUDA device with Triton installed")
            from tokenmill.engine.worker.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

    def _attention_backend(self) -> str:
        """ "native" (C kernel, CPU), "triton" (CUDA) or "portable" (PyTorch ops)."""
        c = self.config
        if native_attention_supports(self.device, self.dtype) and native_attention_fits(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.block_size
        ):
            return "native"
        if uses_triton(self.device):
            from tokenmill.engine.cuda.triton_attention import supports_block_size

            if supports_block_size(self.block_size):
                return "triton"
        return "portable"

    def execute(self, out: SchedulerOutput, previous: PendingStep | None) -> StepResult:
        """Run one scheduled step (`core.step.StepRunner`): build the sampling batch of the
        chunks that sample - their settings, bans and grammar masks, the masks filling
        while the model runs - then compute and sample."""
        seqs = [c.seq for c in out.chunks if c.samples]
        batch = None
        if seqs:
            matchers = [seq.grammar for seq in seqs]
            has_grammar = any(m is not None for m in matchers)
            batch = SamplingBatch.build(
                [s.params for s in seqs],
                [s.generator for s in seqs],
                out.banned_token_ids,
                self.device,
                TokenBitmask(matchers, self.config.vocab_size) if has_grammar else None,
            )
        sampled = self.run(out, batch, previous=previous)
        result = StepResult(sampled)
        masks = batch.token_bitmask if batch is not None else None
        if masks is not None:
            result.num_constrained_tokens = len(masks.rows)
            result.grammar_fill_s = masks.fill_s
            result.grammar_blocking_s = masks.blocking_s
        return result

    @torch.inference_mode()
    def run(
        self,
        out: SchedulerOutput,
        sampling: SamplingBatch | None,
        *,
        previous: PendingStep | None = None,
    ) -> SamplerOutput | None:
        """Compute the step's tokens; return one sampled token per sampling chunk, in the
        order of out.chunks (None when no chunk samples). On CUDA nothing here waits for
        the device: the returned tensors are filled as the step runs.

        Args:
            previous: the step launched before this one, whose sampled tokens some of this
                step's inputs still are (placeholders); they are read on the device.
        """
        prompt_spans = prompt_logprobs.spans_for_step(out.chunks)
        graphs = self.decode_graphs
        if graphs is not None and not prompt_spans and graphs.can_run(out):
            hidden, sample_rows = graphs.run(out, previous)
        else:
            input_ids, positions, meta, sample_rows = self._prepare(out, previous)
            hidden = self.forward_model(input_ids, positions, meta)
        prompt_logprobs.record(prompt_spans, hidden, self.model.compute_logits)
        if not sample_rows:
            return None
        rows = self._tensor(np.asarray(sample_rows))
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return self.sampler(logits, sampling)

    def step_tokens(self, out: SchedulerOutput) -> StepTokens:
        """The step's tokens flattened, chunk by chunk (decodes first): what every
        attention path's inputs are built from. Decode chunks - most chunks of most steps,
        one token each - are handled with plain ints; numpy only pays off for longer ones."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: dict[int, int] = {}  # id(chunk) -> its first token's row in the batch
        tables: list[list[int]] = []
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        for row, chunk in enumerate(out.decodes):
            seq = chunk.seq
            pos = seq.num_computed_tokens
            offsets[id(chunk)] = row
            token_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            tables.append(seq.block_table)
            if seq.num_pending_tokens and pos + 1 == seq.num_tokens:
                # Its token is the previous step's sample, still on the device.
                placeholder_rows.append(row)
                previous_rows.append(seq.pending_row)
        chunk_positions, chunk_slots = (
            [np.asarray(positions, dtype=np.int64)],
            [np.asarray(slots, dtype=np.int64)],
        )
        for chunk in out.prefills:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            offsets[id(chunk)] = len(token_ids)
            token_ids.extend(seq.token_ids[start:end])
            if seq.num_pending_tokens and end == seq.num_tokens:
                placeholder_rows.append(len(token_ids) - 1)
                previous_rows.append(seq.pending_row)
            pos = np.arange(start, end)
            chunk_positions.append(pos)
            chunk_slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            tables.append(seq.block_table)
        return StepTokens(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            positions=np.concatenate(chunk_positions),
            slots=np.concatenate(chunk_slots),
            offsets=offsets,
            tables=tables,
            # Sampled rows in the order of out.chunks, whatever order the tokens went in.
            sample_rows=[offsets[id(c)] + c.num_new_tokens - 1 for c in out.chunks if c.samples],
            placeholder_rows=placeholder_rows,
            previous_rows=previous_rows,
        )

    def fill_placeholders(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        previous_rows: torch.Tensor,
        previous: PendingStep | None,
    ) -> None:
        """input_ids[rows] = the previous step's sampled ids at previous_rows, on the device."""
        if previous is None:
            raise RuntimeError("a placeholder token without the step that samples it")
        input_ids[rows] = previous.device_token_ids[previous_rows]

    def forward_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The model over a flat batch: input_ids, positions [num_tokens] -> hidden states."""
        cos, sin = self.rotary.lookup(positions, self.dtype)
        extra = {}
        if self.local_rotary is not None:
            extra["local_rope"] = self.local_rotary.lookup(positions, self.dtype)
        return self.model(input_ids, cos, sin, meta, **extra)

    def _prepare(self, out: SchedulerOutput, previous: PendingStep | None = None):
        bs = self.block_size
        step = self.step_tokens(out)
        input_ids = self._tensor(step.token_ids)
        if step.placeholder_rows:
            self.fill_placeholders(
                input_ids,
                self._tensor(np.asarray(step.placeholder_rows)),
                self._tensor(np.asarray(step.previous_rows)),
                previous,
            )
        offsets, tables, slot_mapping = step.offsets, step.tables, step.slots
        num_decodes = len(out.decodes)
        decode_tables, prefill_tables = tables[:num_decodes], tables[num_decodes:]
        decode_lens = [chunk.seq.num_computed_tokens + 1 for chunk in out.decodes]
        native = triton = None
        prefills: list[PrefillSpan] = []
        if self.attention_backend == "native":
            native = self._attention_entries(
                out, offsets, decode_tables, decode_lens, prefill_tables
            )
        elif self.attention_backend == "triton":
            triton = self._triton_attention(out, tables)
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

        decode_block_tables = decode_context_lens = None
        if decode_tables and self.attention_backend == "portable":
            decode_block_tables = self._padded_block_tables(decode_tables, decode_lens)
            decode_context_lens = self._tensor(np.asarray(decode_lens))
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_mapping // bs),
            slot_offsets=self._tensor(slot_mapping % bs),
            num_decode_tokens=len(decode_lens),
            block_size=bs,
            native=native,
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            prefills=prefills,
            triton=triton,
        )
        return input_ids, self._tensor(step.positions), meta, step.sample_rows

    def _triton_attention(self, out: SchedulerOutput, tables: list[list[int]]) -> TritonAttention:
        """The step's sequences as the Triton kernels take them: decodes, then prompt
        chunks cut into tiles."""
        from tokenmill.engine.cuda import triton_attention as ta

        num_queries = [c.num_new_tokens for c in out.chunks]
        seq_lens = [c.seq.num_computed_tokens + c.num_new_tokens for c in out.chunks]
        heads_per_kv = self.config.num_attention_heads // self.config.num_key_value_heads
        tile_size = ta.prefill_tile_queries(heads_per_kv, self.config.head_dim)
        num_decodes = len(out.decodes)
        tile_seqs, tile_queries = ta.chunk_tiles(num_queries[num_decodes:], num_decodes, tile_size)
        return ta.TritonAttention(
            query_starts=self._tensor(np.cumsum([0, *num_queries])),
            seq_lens=self._tensor(np.asarray(seq_lens)),
            block_tables=self._padded_block_tables(tables, seq_lens),
            num_decodes=num_decodes,
            tile_seqs=self._tensor(tile_seqs),
            tile_queries=self._tensor(tile_queries),
            tile_size=tile_size,
        )

    def _attention_entries(
        self,
        out: SchedulerOutput,
        offsets: dict[int, int],
        decode_tables: list[list[int]],
        decode_lens: list[int],
        prefill_tables: list[list[int]],
    ) -> AttentionEntries:
        """The step's tokens as the native kernel's entries: each prompt chunk alone, then
        the decoding sequences in groups that share prefix blocks, then the rest."""
        rows: list[int] = []
        queries: list[int] = []
        contexts: list[int] = []
        tables: list[list[int]] = []
        starts, shared = [0], []

        def add_group(members: list[tuple[ScheduledChunk, list[int]]], shared_blocks: int):
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

    def _padded_block_tables(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """[len(tables), max_blocks] block ids, padded with block 0 to the blocks the
        longest of `lengths` (one per table) needs."""
        max_blocks = -(-max(lengths) // self.block_size)
        padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for row, table in enumerate(tables):
            n = min(len(table), max_blocks)
            padded[row, :n] = table[:n]
        return self._tensor(padded)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """An int64 copy of array on the device, uploaded without waiting on CUDA."""
        return self.staged(array).to(self.device, non_blocking=True)

    def staged(self, array: np.ndarray) -> torch.Tensor:
        """array as an int64 host tensor to upload from: in pinned memory on CUDA, where a
        pageable source would make the copy synchronous. Pinned blocks come from torch's
        caching host allocator, which does not reuse one before its copy has run."""
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return host.pin_memory() if self.device.type == "cuda" else host
