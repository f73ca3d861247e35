"""The native CPU backend: one C kernel call per layer attends to every query token of
a step, reading the paged cache in place (`kernels/paged_attention.c`).

It serves fp32 and bf16 on the CPU, and reads an int8 cache as well as one in the
model's dtype (`worker/kv_cache/int8.py`); it computes attention sinks (gpt-oss).
Decoding sequences whose block tables start with the same blocks are attended to as one
group, so a shared prefix is read once per step for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.core.step import ScheduledChunk, SchedulerOutput
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries,
    native_attention_fits,
    native_attention_supports,
    native_paged_attention,
    write_kv_cache,
)
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.worker.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    StepTokens,
    padded_block_tables,
    upload,
)
from tokenmill.engine.worker.attention.shared_prefix import group_shared_prefixes

# Query rows (sequences x query heads per kv head) the kernel attends to in one item when
# decoding sequences share prefix blocks: enough to read a shared prefix once for a large
# batch, few enough that its scores stay in L2 and both threads get work.
SHARED_PREFIX_ROWS = 96


@dataclass
class NativeMetadata(StepAttention):
    slot_blocks: torch.Tensor  # [num_tokens] the cache block of each new key and value
    slot_offsets: torch.Tensor  # [num_tokens] its offset in the block
    entries: AttentionEntries  # every query token, as the kernel takes them

    def attend(self, q, k, v, k_cache, v_cache, scale, sliding_window=None, sinks=None):
        write_kv_cache(k, v, k_cache, v_cache, self.slot_blocks, self.slot_offsets)
        return native_paged_attention(
            q, k_cache, v_cache, self.entries, scale, sliding_window, sinks
        )


class NativeBackend(AttentionBackend):
    name = "native"
    owns_cache_layout = True
    computes_sinks = True

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        if not native_attention_supports(spec.device, spec.dtype):
            return (
                "runs on the CPU only, in fp32 or bf16, with tokenmill's native kernels "
                "built (they need a C compiler)"
            )
        if not native_attention_fits(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size
        ):
            return (
                f"does not take this attention shape (head_dim {spec.head_dim}, "
                f"{spec.heads_per_kv_head} query heads per kv head) with block_size "
                f"{spec.block_size}"
            )
        return None

    def build(self, step: StepTokens, out: SchedulerOutput) -> NativeMetadata:
        """The step's tokens as the kernel's entries: each prompt chunk alone, then the
        decoding sequences in groups that share prefix blocks, then the rest."""
        device, bs = self.spec.device, self.spec.block_size
        num_decodes = len(out.decodes)
        decode_tables, prefill_tables = step.tables[:num_decodes], step.tables[num_decodes:]
        decode_lens = [chunk.seq.num_computed_tokens + 1 for chunk in out.decodes]
        rows: list[int] = []
        queries: list[int] = []
        contexts: list[int] = []
        tables: list[list[int]] = []
        starts, shared = [0], []

        def add_group(members: list[tuple[ScheduledChunk, list[int]]], shared_blocks: int):
            for chunk, table in members:
                rows.append(step.offsets[id(chunk)])
                queries.append(chunk.num_new_tokens)
                contexts.append(chunk.seq.num_computed_tokens + chunk.num_new_tokens)
                tables.append(table)
            starts.append(len(rows))
            shared.append(shared_blocks)

        # Prompt chunks first: their tiles are the largest items, best started early.
        for chunk, table in zip(out.prefills, prefill_tables):
            add_group([(chunk, table)], 0)
        max_members = max(2, SHARED_PREFIX_ROWS // self.spec.heads_per_kv_head)
        groups, alone = group_shared_prefixes(decode_tables, decode_lens, bs, max_members)
        for group in groups:
            add_group(
                [(out.decodes[i], decode_tables[i]) for i in group.members], group.shared_blocks
            )
        for i in alone:
            add_group([(out.decodes[i], decode_tables[i])], 0)
        entries = AttentionEntries(
            rows=upload(np.asarray(rows), device),
            queries=upload(np.asarray(queries), device),
            contexts=upload(np.asarray(contexts), device),
            block_tables=padded_block_tables(tables, contexts, bs, device),
            group_starts=upload(np.asarray(starts), device),
            group_shared_blocks=upload(np.asarray(shared), device),
        )
        return NativeMetadata(
            slot_blocks=upload(step.slots // bs, device),
            slot_offsets=upload(step.slots % bs, device),
            entries=entries,
        )
