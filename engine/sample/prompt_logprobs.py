"""Prompt log-probabilities, computed from the same forward pass that fills the cache.

Prompt token i (i >= 1) is scored by the logits at position i - 1. A sequence that asked
(`SamplingParams.prompt_logprobs`) keeps one entry per prompt token in
`seq.prompt_logprobs`, `None` for token 0 as vLLM does, appended as its prompt chunks
run: the rows of a step's batch at positions whose entry is not recorded yet go
through the lm_head, and only those.

The prefix cache would skip the positions of a cached prefix, so a sequence is served
from it only up to what it has already recorded (the scheduler caps its hits with
`Sequence.num_cacheable_tokens`); the rest is computed again for it, at the cost of computing
those tokens - the price of exact scores (docs/design.md, "Prompt log-probabilities are
computed, not cached"). After a preemption the recorded entries stand and only the
unrecorded positions are scored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.core.step import Sequence

# Rows of logits materialised at once: [256, vocab] fp32 is 50 MB for a 49k vocabulary
# (256 MB for a 262k one), however long the prompt chunk.
ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobSpan:
    """Consecutive prompt tokens of one sequence scored in this step."""

    seq: Sequence
    first_row: int  # the batch row (position first_token - 1) whose logits score first_token
    first_token: int  # index in the prompt of the first token scored
    num_tokens: int


def spans_for_step(chunks) -> list[PromptLogprobSpan]:
    """The prompt tokens each of a step's chunks scores.

    Args:
        chunks: the step's ScheduledChunks, in the order their tokens are laid out in the
            batch (SchedulerOutput.chunks: decodes first).
    """
    spans = []
    first_row = 0
    for chunk in chunks:
        seq = chunk.seq
        start = seq.num_computed_tokens
        if seq.prompt_logprobs is not None:
            first = max(start, len(seq.prompt_logprobs) - 1)  # positions not scored yet
            last = min(start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)
            if last > first:
                row = first_row + first - start
                spans.append(PromptLogprobSpan(seq, row, first + 1, last - first))
        first_row += chunk.num_new_tokens
    return spans


@torch.no_grad()
def record(
    spans: list[PromptLogprobSpan],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Score the spans' tokens and append their entries to each sequence.

    Args:
        spans: from spans_for_step.
        hidden: [num_tokens, hidden] the step's final hidden states.
        compute_logits: the model's lm_head, [rows, hidden] -> fp32 [rows, vocab].
    """
    if not spans:
        return
    device = hidden.device
    rows = torch.cat([torch.arange(s.first_row, s.first_row + s.num_tokens) for s in spans])
    targets = torch.tensor(
        [t for s in spans for t in s.seq.token_ids[s.first_token : s.first_token + s.num_tokens]]
    )
    top_k = max(s.seq.params.prompt_logprobs for s in spans)
    actual, top_values, top_ids = [], [], []
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        part = rows[lo : lo + ROWS_PER_SLICE].to(device)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, part)), dim=-1)
        actual.append(logprobs.gather(1, targets[lo : lo + ROWS_PER_SLICE, None].to(device)))
        if top_k:
            values, ids = logprobs.topk(top_k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    target_ids = targets.tolist()
    actual_list = torch.cat(actual).squeeze(1).tolist()
    values_list = torch.cat(top_values).tolist() if top_k else None
    ids_list = torch.cat(top_ids).tolist() if top_k else None
    at = 0
    for span in spans:
        k = span.seq.params.prompt_logprobs
        for _ in range(span.num_tokens):
            entry = {target_ids[at]: actual_list[at]}
            if k:
                for token_id, value in zip(ids_list[at][:k], values_list[at][:k]):
                    entry.setdefault(token_id, value)
            span.seq.prompt_logprobs.append(entry)
            at += 1
