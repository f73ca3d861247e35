"""One sequence being generated: its tokens, progress and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    # token scored so far, None for token 0 (engine/prompt_logprobs.py).
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
