"""The types one engine step is made of - data only, shared by the loop and the worker.

The loop (`core/`) schedules `Sequence`s into a `SchedulerOutput` of `ScheduledChunk`s;
the worker (`worker/`) executes it and returns a `SamplerOutput`; a step whose sampled
tokens may still be on the device is a `PendingStep`. Nothing here computes: the loop
and the worker meet only through these types.

A launched step is resolved later when steps overlap (on CUDA): the engine launches
step N, then - while the device computes it - turns step N-1's sampled tokens into
sequence updates, finished requests and the next schedule. Each sampling sequence of a
launched step holds a placeholder token until the step is resolved; the next step reads
the real ids on the device (the runner gathers them from `token_ids`), so the host
never waits for them before launching.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.engine.core.images import ImageSpan
from tokenmill.engine.types.pooling_params import PoolingParams
from tokenmill.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class PoolingState:
    """A pooling request's progress through its prompt (decoders in the decode loop).

    The worker (`pooling/pooler.py`) folds each computed prompt chunk into `partial` and
    sets `result` when the last one is computed; the loop only carries it.
    """

    params: PoolingParams
    # The pooling reads every prompt row (mean, max, first token ...), so the prefix
    # cache may serve only rows already folded in; last-token pooling reads one row,
    # always computed.
    reads_every_token: bool
    num_pooled: int = 0  # leading prompt positions folded into `partial`
    partial: Any = None  # the worker's running sums
    result: torch.Tensor | None = None  # fp32 on the CPU, once the prompt is computed


@dataclass(eq=False)
class Sequence:
    """A prompt plus the tokens generated so far for one of a request's n completions.

    num_computed_tokens counts tokens whose keys and values are in the cache; each step
    the scheduler lets it catch up towards len(token_ids), which is how chunked prefill
    and decode are one mechanism.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    # The LoRA adapter its tokens run with (0: the base model). The runner maps it to a
    # slot of loaded adapter weights; it keys the sequence's prefix-cache blocks, so KV
    # computed under one adapter is never served to another.
    lora_id: int = 0
    # The rotary frequencies it runs with, where they depend on the sequence's length
    # (models/rope.py; 0 otherwise), fixed when it is added; it keys its prefix-cache
    # blocks as the adapter does.
    rope_variant: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks registered in (or served from) the prefix cache
    block_table: list[int] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at first admission (what the ledger bills).
    num_cached_prompt_tokens: int | None = None
    # Chained hashes of the full blocks of token_ids, extended by the block manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Hashes of prompt blocks this sequence is yet to compute while running; a waiting
    # sequence whose next block is among them waits a step instead of computing it twice.
    inflight_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    # With stop strings: the completion's text so far, decoded a token at a time, and
    # the text cut at the stop string once one is found.
    detokenizer: Any = None
    stop_text: str | None = None
    logprobs: list[dict[int, float]] | None = None
    # With structured outputs: the grammar state after the resolved generated tokens
    # (advanced only where a sampled token replaces its placeholder, so recomputing a
    # preempted sequence leaves it alone).
    grammar: GrammarMatcher | None = None
    # With SamplingParams.prompt_logprobs (first completion only): one entry per prompt
    # token scored so far, None for token 0 (engine/sample/prompt_logprobs.py).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Overlapped steps (`LLMEngine(overlap_steps=True)`): the token sampled by a step still
    # running is held by a placeholder at the end of token_ids until that step is resolved;
    # pending_row is its row in that step's sampled tokens. is_finishing: that token is the
    # last (max_tokens or the context reached), so there is nothing more to schedule.
    num_pending_tokens: int = 0
    pending_row: int = -1
    is_finishing: bool = False
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    # A pooling request (nothing is sampled): its progress and result.
    pooling: PoolingState | None = None
    # The prompt's images, in order (core/images.py): a bidirectional one never split
    # across prefill chunks, each part of the identity of the KV blocks holding it, and
    # - for a model with M-RoPE - what its tokens' 3D positions follow from (core/mrope.py).
    images: tuple[ImageSpan, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose ids are known (all but a pending placeholder)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prompt_only(self) -> bool:
        """The request ends once its prompt is computed: it scores the prompt
        (max_tokens=0) or pools it."""
        return self.params.is_prompt_only or self.pooling is not None

    @property
    def num_cacheable_tokens(self) -> int | None:
        """How many leading tokens may come from the prefix cache (None: no limit).

        With prompt log-probabilities a token's keys and values may come from the cache
        only when the score it gives (of the token after it) is already recorded; a
        pooling that reads every row, only when the row is folded in.
        """
        limits = []
        if self.prompt_logprobs is not None:
            limits.append(len(self.prompt_logprobs) - 1)
        if self.pooling is not None and self.pooling.reads_every_token:
            limits.append(self.pooling.num_pooled)
        return min(limits) if limits else None


@dataclass
class ScheduledChunk:
    """num_new_tokens of seq's tokens, from seq.num_computed_tokens on, run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def reaches_end(self) -> bool:
        """Whether the chunk computes the sequence's last token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the chunk's last logits are sampled: it reaches the sequence's end, and
        the sequence generates (a prompt-only one ends there instead)."""
        return self.reaches_end and not self.seq.is_prompt_only


@dataclass
class SchedulerOutput:
    """One step's work: single-token chunks (decodes) first, then longer chunks."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    # Per sampling chunk (in the order of `chunks`), the token ids it may not sample now:
    # stop tokens, EOS before min_tokens, bad words (set by the loop before the step runs).
    banned_token_ids: list[list[int]] = field(default_factory=list)
    # Per sampling chunk, bans that depend on the sequence's pending token (overlapped
    # steps): (token id, the pending token id that bans it). A bad word's last token is
    # banned when the output ends with the rest of the word, the pending token included.
    conditional_bans: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.decodes) + sum(
            c.num_new_tokens for c in self.prefills
        )

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] long
    # With logprobs: the sampled token's logprob [num_rows], and the top-k [num_rows, k].
    sampled_logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None


# Stands for a token id not known yet; never a valid id, so a bug that lets one reach the
# model fails loudly (an out-of-range embedding index) instead of computing quietly.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class PendingStep:
    """The sampling sequences of one launched step, in row order, and what they sampled."""

    seqs: list[Sequence]
    sampled: SamplerOutput  # on the device
    _host: SamplerOutput | None = field(default=None, repr=False)  # pinned copies (CUDA)
    _copied: torch.cuda.Event | None = field(default=None, repr=False)

    @classmethod
    def launch(cls, seqs: list[Sequence], sampled: SamplerOutput) -> PendingStep:
        """Start copying what was sampled to the host, without waiting for it."""
        step = cls(seqs, sampled)
        if sampled.token_ids.device.type == "cuda":

            def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None:
                    return None
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return host.copy_(t, non_blocking=True)

            step._host = SamplerOutput(
                token_ids=pinned(sampled.token_ids),
                sampled_logprobs=pinned(sampled.sampled_logprobs),
                top_logprobs=pinned(sampled.top_logprobs),
                top_token_ids=pinned(sampled.top_token_ids),
            )
            step._copied = torch.cuda.Event()
            step._copied.record()
        return step

    @property
    def device_token_ids(self) -> torch.Tensor:
        """[num_rows] the sampled ids, on the device (for the next step's inputs)."""
        return self.sampled.token_ids

    def host_sampled(self) -> SamplerOutput:
        """What was sampled, on the host; waits only for this step's copies."""
        if self._copied is None:
            return self.sampled
        self._copied.synchronize()
        return self._host


@dataclass
class StepResult:
    """What running one step gave back to the loop."""

    # One token per sampling chunk, in the order of SchedulerOutput.chunks (on the device,
    # maybe still being computed); None when no chunk samples.
    sampled: SamplerOutput | None
    # Structured outputs: tokens sampled under a grammar this step, seconds spent filling
    # their masks, and seconds the step was held up by them.
    num_constrained_tokens: int = 0
    grammar_fill_s: float = 0.0
    grammar_blocking_s: float = 0.0
    # Mixture of experts on the CPU: each MoE layer's distinct experts, summed over the
    # step's layers (what it read of the experts' weights); 0 where not counted.
    num_experts_used: int = 0


class StepRunner(Protocol):
    """What the loop needs of whatever executes its steps (`worker.ModelRunner`)."""

    device: torch.device

    def execute(self, out: SchedulerOutput, previous: PendingStep | None) -> StepResult:
        """Compute the step's tokens and sample where a chunk reaches its end.

        Args:
            previous: the step launched before this one, whose sampled tokens some of this
                step's inputs still are (placeholders).
        """
        ...
