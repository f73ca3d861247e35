"""Continuous batching under a per-step token budget.

There are no prefill and decode phases: each step, every scheduled sequence's
num_computed_tokens catches up towards its length by as many tokens as the budget
allows. A long prompt is therefore chunked across steps naturally, and a decoding
sequence simply needs one token. Running sequences are served first, in admission
order; when blocks run out the most recently admitted sequence is preempted (its
blocks freed, to be recomputed later - mostly from the prefix cache).

How many run at once: `max_num_seqs` where the user set it - sequences are then
admitted while their prompt's next chunk fits, and preempted when decode outgrows the
cache. Unset, the cache decides (up to MAX_RUNNING_SEQS): a sequence is admitted only
while the free blocks hold the rest of its prompt and its whole max_tokens besides what
every running sequence may still grow into, so none is ever preempted - preemption
recomputes a sequence's prompt and every token it generated, which at a large model
and a small cache costs more than the rows that wait. A row that stops early at an
end-of-sequence token leaves blocks unused that the reserve held; that is the price.

Shared prefixes are computed once: a waiting sequence whose next uncached block is
being computed by a running sequence waits until that block lands in the prefix
cache, rather than computing the same keys and values alongside it.

LoRA adapters: the sequences running at once use at most `max_loras` distinct adapters
(the runner's slots); a waiting sequence of another adapter waits until one of them has
no sequence left running, and the sequences behind it are admitted meanwhile. Within a
step, single-token and longer chunks are each ordered by adapter, so every adapter's rows
form one contiguous run of the step's batch (what the runner's LoRA layers slice).
"""

from __future__ import annotations

from collections import Counter, deque

from tokenmill.engine.core.block_manager import BlockManager
from tokenmill.engine.core.images import fit_chunk
from tokenmill.engine.core.step import ScheduledChunk, SchedulerOutput, Sequence, SequenceStatus
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.outputs import EngineStats


class Scheduler:
    """Args:
    block_manager: the KV blocks and prefix cache it allocates from.
    engine_config: its limits (max_num_batched_tokens, max_num_seqs, max_loras).
    stats: the engine's counters (preemptions, computed and cached prompt tokens).
    max_seq_len: the most tokens a sequence reaches (the context, or the whole cache if
        less); where max_num_seqs is unset, what a sequence's reserve is capped at.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        engine_config: EngineConfig,
        *,
        stats: EngineStats,
        max_seq_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.max_num_seqs = engine_config.seq_cap
        # Admit only what the cache holds at full length (module docstring).
        self.reserve_full_length = engine_config.derives_running_seqs
        self.max_seq_len = max_seq_len or block_manager.num_blocks * block_manager.block_size
        self.max_loras = engine_config.max_loras  # distinct adapters running at once
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.inflight: Counter[bytes] = Counter()  # prompt block hash -> running seqs computing it

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, oldest first; preempt from the young end when full.
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.is_finishing:  # its last token is being sampled: nothing to compute
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.images:  # a chunk never ends inside a bidirectional image (core/images.py)
                num_new = fit_chunk(seq.images, seq.num_computed_tokens, num_new)
                if not num_new:
                    i += 1
                    continue
            target = seq.num_computed_tokens + num_new
            if target <= len(seq.block_table) * bm.block_size:
                # The blocks it holds have room (most decode steps): nothing to allocate.
                self._add_chunk(out, ScheduledChunk(seq, num_new))
                budget -= num_new
                i += 1
                continue
            while not bm.can_allocate(seq, target):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.allocate(seq, target)
                self._add_chunk(out, ScheduledChunk(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # 2. Waiting sequences, first come first served, unless this step had to preempt.
        if not preempted:
            budget = self._admit_waiting(out, budget)
        _group_by_adapter(out.decodes)
        _group_by_adapter(out.prefills)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        deferred: list[Sequence] = []
        adapters = self._running_adapters()
        # Blocks the running sequences may still take before they finish.
        growth = (
            sum(self._blocks_to_finish(s) for s in self.running) if self.reserve_full_length else 0
        )
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                deferred.append(self.waiting.popleft())  # every adapter slot is taken
                continue
            hits = bm.find_cached_prefix(seq)
            allowed = seq.num_cacheable_tokens
            if allowed is not None:  # prompt logprobs: served only as far as recorded
                hits = hits[: allowed // bm.block_size]
            elif self._next_block_is_inflight(seq, len(hits)):
                deferred.append(self.waiting.popleft())
                continue
            num_cached = len(hits) * bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if seq.images:
                num_new = fit_chunk(seq.images, num_cached, num_new)
                if not num_new:  # the image it starts in waits for a step with room
                    break
            if not bm.can_allocate(seq, num_cached + num_new, hits):
                break
            if self.reserve_full_length:
                whole = bm.blocks_to_take(seq, self._full_length(seq), hits)
                if whole + growth > bm.num_free_blocks:
                    break  # it would outgrow the cache with those running: it waits
            self.waiting.popleft()
            bm.allocate(seq, num_cached + num_new, hits)
            seq.num_computed_tokens = num_cached
            if seq.num_cached_prompt_tokens is None:  # billed once, at first admission
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
                self.stats.cached_prompt_tokens += seq.num_cached_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.reserve_full_length:
                growth += self._blocks_to_finish(seq)
            if seq.lora_id:
                adapters.add(seq.lora_id)
            self._track_inflight(seq, len(hits))
            self._add_chunk(out, ScheduledChunk(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _full_length(self, seq: Sequence) -> int:
        """The tokens seq holds when it finishes at the latest: its prompt, plus its
        max_tokens unless it only pools its prompt."""
        budget = 0 if seq.pooling is not None else seq.params.max_tokens
        return min(seq.num_prompt_tokens + budget, self.max_seq_len)

    def _blocks_to_finish(self, seq: Sequence) -> int:
        """The free blocks a running seq may still take: its full length's blocks beyond
        those it holds."""
        need = self.block_manager.blocks_needed(self._full_length(seq))
        return max(0, need - len(seq.block_table))

    def _running_adapters(self) -> set[int]:
        """The adapters of the running sequences."""
        return {seq.lora_id for seq in self.running if seq.lora_id}

    def _next_block_is_inflight(self, seq: Sequence, num_hit_blocks: int) -> bool:
        if not self.block_manager.enable_prefix_caching:
            return False
        hashes = self.block_manager.block_hashes(seq)
        return num_hit_blocks < len(hashes) and self.inflight[hashes[num_hit_blocks]] > 0

    def _track_inflight(self, seq: Sequence, num_hit_blocks: int) -> None:
        if not self.block_manager.enable_prefix_caching:
            return
        num_prompt_blocks = seq.num_prompt_tokens // self.block_manager.block_size
        seq.inflight_hashes = seq.block_hashes[num_hit_blocks:num_prompt_blocks]
        self.inflight.update(seq.inflight_hashes)

    def _untrack_inflight(self, seq: Sequence, num_done: int | None = None) -> None:
        """Drop the first num_done (default: all) of seq's in-flight block hashes."""
        done = seq.inflight_hashes if num_done is None else seq.inflight_hashes[:num_done]
        if not done:
            return
        self.inflight.subtract(done)
        for block_hash in done:
            if self.inflight[block_hash] <= 0:
                del self.inflight[block_hash]
        seq.inflight_hashes = seq.inflight_hashes[len(done) :]

    @staticmethod
    def _add_chunk(out: SchedulerOutput, chunk: ScheduledChunk) -> None:
        (out.decodes if chunk.num_new_tokens == 1 else out.prefills).append(chunk)

    def _preempt(self, seq: Sequence) -> None:
        self._untrack_inflight(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def record_computed(self, out: SchedulerOutput) -> None:
        """Advance every scheduled sequence past this step's tokens, and register the
        blocks they filled in the prefix cache."""
        block_size = self.block_manager.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished:
                # Finished (by a token resolved after this step was launched): its blocks
                # are already freed and this step's work for it is discarded.
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_left = seq.num_prompt_tokens - seq.num_computed_tokens
                self.stats.computed_prompt_tokens += min(prompt_left, chunk.num_new_tokens)
            seq.num_computed_tokens += chunk.num_new_tokens
            if seq.num_computed_tokens // block_size > seq.num_cached_blocks:  # filled a block
                cached_before = seq.num_cached_blocks
                self.block_manager.cache_full_blocks(seq)
                self._untrack_inflight(seq, seq.num_cached_blocks - cached_before)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._untrack_inflight(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was being sampled
            self.waiting.remove(seq)


def _group_by_adapter(chunks: list[ScheduledChunk]) -> None:
    """Order chunks by adapter, in place (stable: admission order within an adapter), so
    each adapter's rows are contiguous; a step without adapters is left as it is."""
    if any(c.seq.lora_id for c in chunks):
        chunks.sort(key=lambda c: c.seq.lora_id)
