"""Per-request edits of a step's logits: penalties, logit bias, allowed tokens, bans that
wait on the previous step's token.

Every edit touches only the (row, token) pairs it is about, as gathers and scatters on
the logits' device; a step whose requests use none of them builds nothing and pays
nothing. Vocabulary-wide work happens only for rows with `allowed_token_ids` (their row
is masked whole).

Penalties count tokens without a [num_rows, vocab] count table: the host lists each
penalized row's tokens (output tokens with repeats, the prompt's distinct tokens for the
repetition penalty) and the device counts them in a scratch buffer that is cleared again
at the same positions, so a step costs O(tokens listed), not O(rows x vocab).

Overlapped steps: a sequence's last token may still be on the device (a placeholder in
`token_ids`, `Sequence.pending_row` in the previous step's samples). Its penalty pair is
listed with a placeholder and filled from the previous step's sampled ids on the device,
and a bad word that ends on that token becomes a conditional ban, decided there too - so
the host never waits for the token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.core.step import Sequence


@dataclass
class PenaltyInputs:
    """The (row, token) pairs of a step's penalized rows, and each row's penalties."""

    rows: torch.Tensor  # [num_pairs] long: the logits row of each pair
    local_rows: torch.Tensor  # [num_pairs] long: its row among the penalized rows
    token_ids: torch.Tensor  # [num_pairs] long; a placeholder where pending_positions say
    is_output: torch.Tensor  # [num_pairs] float: 1 for a generated token, 0 for a prompt one
    # Pairs whose token is the previous step's sample: positions and that step's rows.
    pending_positions: torch.Tensor | None
    pending_rows: torch.Tensor | None
    # [3, num_pairs] float: each pair's row's repetition, frequency and presence penalty
    # (repeated on the host: a gather of a [rows, 3] table per pair costs more).
    penalties: torch.Tensor
    num_penalized: int


@dataclass
class LogitControls:
    """One step's logit edits. Built on the host from the sampling sequences; applied by
    the sampler in two parts, around the grammar mask (`apply_before_mask`: penalties,
    then bias; `apply_after_mask`: allowed tokens, then conditional bans)."""

    penalties: PenaltyInputs | None = None
    # logit_bias as (row, token id, bias) triples.
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # allowed_token_ids: the restricted rows, and (row, token id) pairs of what they allow.
    allowed_rows: torch.Tensor | None = None
    allowed_pair_rows: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None
    # Bans that hold when the previous step's token at previous_rows equals required_ids.
    conditional_rows: torch.Tensor | None = None
    conditional_token_ids: torch.Tensor | None = None
    conditional_previous_rows: torch.Tensor | None = None
    conditional_required_ids: torch.Tensor | None = None
    # The previous step's sampled ids, on the device (overlapped steps only).
    previous_token_ids: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        conditional_bans: list[list[tuple[int, int]]],
        device: torch.device,
        previous_token_ids: torch.Tensor | None = None,
    ) -> LogitControls | None:
        """The edits a step's sampling sequences ask for; None when there are none.

        Args:
            seqs: the sampling sequences, in row order.
            conditional_bans: per row, (token id, the pending token that bans it).
            device: the logits' device.
            previous_token_ids: the previous step's sampled ids, on the device.
        """
        controls = cls(previous_token_ids=previous_token_ids)
        found = False
        penalized = [(row, seq) for row, seq in enumerate(seqs) if seq.params.has_penalties]
        if penalized:
            controls.penalties = _penalty_inputs(penalized, device)
            found = True
        bias = [
            (row, token, value)
            for row, seq in enumerate(seqs)
            for token, value in (seq.params.logit_bias or {}).items()
        ]
        if bias:
            rows, tokens, values = zip(*bias)
            controls.bias_rows = _put(rows, torch.int64, device)
            controls.bias_token_ids = _put(tokens, torch.int64, device)
            controls.bias_values = _put(values, torch.float32, device)
            found = True
        allowed = [(row, seq.params.allowed_token_ids) for row, seq in enumerate(seqs)]
        allowed = [(row, ids) for row, ids in allowed if ids is not None]
        if allowed:
            controls.allowed_rows = _put([row for row, _ in allowed], torch.int64, device)
            pairs = [(row, token) for row, ids in allowed for token in ids]
            controls.allowed_pair_rows = _put([r for r, _ in pairs], torch.int64, device)
            controls.allowed_token_ids = _put([t for _, t in pairs], torch.int64, device)
            found = True
        conditional = [
            (row, token, seqs[row].pending_row, required)
            for row, bans in enumerate(conditional_bans)
            for token, required in bans
        ]
        if conditional:
            if previous_token_ids is None:
                raise RuntimeError("a ban on a pending token without the step that samples it")
            rows, tokens, previous_rows, required = zip(*conditional)
            controls.conditional_rows = _put(rows, torch.int64, device)
            controls.conditional_token_ids = _put(tokens, torch.int64, device)
            controls.conditional_previous_rows = _put(previous_rows, torch.int64, device)
            controls.conditional_required_ids = _put(required, torch.int64, device)
            found = True
        penalties = controls.penalties
        has_pending = penalties is not None and penalties.pending_positions is not None
        if has_pending and previous_token_ids is None:
            raise RuntimeError("a pending token without the step that samples it")
        return controls if found else None

    def apply_before_mask(self, logits: torch.Tensor, scratch: PenaltyScratch) -> None:
        """Penalties, then logit bias, in place. logits: [num_rows, vocab] contiguous."""
        if self.penalties is not None:
            apply_penalties(logits, self.penalties, scratch, self.previous_token_ids)
        if self.bias_rows is not None:
            logits.index_put_(
                (self.bias_rows, self.bias_token_ids), self.bias_values, accumulate=True
            )

    def apply_after_mask(self, logits: torch.Tensor) -> None:
        """allowed_token_ids, then the conditional bans, in place."""
        if self.allowed_rows is not None:
            kept = logits[self.allowed_pair_rows, self.allowed_token_ids]
            logits.index_fill_(0, self.allowed_rows, float("-inf"))
            logits[self.allowed_pair_rows, self.allowed_token_ids] = kept
        if self.conditional_rows is not None:
            pending = self.previous_token_ids[self.conditional_previous_rows]
            hit = pending == self.conditional_required_ids
            # Added, not assigned: two conditions on one (row, token) must both count.
            bans = torch.zeros(hit.shape, dtype=logits.dtype, device=logits.device)
            bans.masked_fill_(hit, float("-inf"))
            logits.index_put_(
                (self.conditional_rows, self.conditional_token_ids), bans, accumulate=True
            )


class PenaltyScratch:
    """A zeroed count buffer, [rows x vocab] for the most penalized rows a step has had.

    Only the positions a step counts are written, and they are zeroed again before it
    returns, so the buffer is filled with zeros once and never cleared whole.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def counts(self, size: int, device: torch.device) -> torch.Tensor:
        """A zeroed float32 buffer of at least `size` values on `device`."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self._buffer = torch.zeros(size, dtype=torch.float32, device=device)
        return buffer


def apply_penalties(
    logits: torch.Tensor,
    inputs: PenaltyInputs,
    scratch: PenaltyScratch,
    previous_token_ids: torch.Tensor | None,
) -> None:
    """Repetition, then presence and frequency penalties, in place, on the listed pairs.

    Each pair's new logit depends only on its (row, token) and that token's count, so a
    token listed many times gets the same value from each of its pairs, and writing them
    all (duplicates included) is exact.
    """
    vocab = logits.shape[-1]
    token_ids = inputs.token_ids
    if inputs.pending_positions is not None:
        token_ids = token_ids.clone()
        token_ids[inputs.pending_positions] = previous_token_ids[inputs.pending_rows]
    # Output occurrences of each pair's token in its row.
    counts = scratch.counts(inputs.num_penalized * vocab, logits.device)
    local_keys = inputs.local_rows * vocab + token_ids
    counts.index_add_(0, local_keys, inputs.is_output)
    count = counts[local_keys]
    counts.index_fill_(0, local_keys, 0.0)
    flat = logits.view(-1)
    keys = inputs.rows * vocab + token_ids
    values = flat[keys]
    repetition, frequency, presence = inputs.penalties.unbind(0)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= frequency * count + presence * (count > 0).to(values.dtype)
    flat[keys] = values


# A sequence's distinct prompt tokens, computed once (the prompt never changes).
_PROMPT_TOKENS: weakref.WeakKeyDictionary[Sequence, np.ndarray] = weakref.WeakKeyDictionary()


def _distinct_prompt_tokens(seq: Sequence) -> np.ndarray:
    tokens = _PROMPT_TOKENS.get(seq)
    if tokens is None:
        tokens = np.unique(np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int64))
        _PROMPT_TOKENS[seq] = tokens
    return tokens


def _penalty_inputs(penalized: list[tuple[int, Sequence]], device: torch.device) -> PenaltyInputs:
    """The pairs of the penalized rows: each generated token (repeats included), the
    pending one as a placeholder, and with a repetition penalty the distinct prompt tokens."""
    parts: list[np.ndarray] = []
    rows: list[int] = []
    local_rows: list[int] = []
    sizes: list[int] = []
    num_outputs: list[int] = []
    pending_positions: list[int] = []
    pending_rows: list[int] = []
    offset = 0
    for local, (row, seq) in enumerate(penalized):
        output = np.asarray(
            seq.token_ids[seq.num_prompt_tokens : seq.num_resolved_tokens], dtype=np.int64
        )
        parts.append(output)
        num_output = len(output)
        if seq.num_pending_tokens:
            parts.append(np.zeros(1, dtype=np.int64))
            pending_positions.append(offset + num_output)
            pending_rows.append(seq.pending_row)
            num_output += 1
        size = num_output
        if seq.params.repetition_penalty != 1.0:
            prompt = _distinct_prompt_tokens(seq)
            parts.append(prompt)
            size += len(prompt)
        rows.append(row)
        local_rows.append(local)
        sizes.append(size)
        num_outputs.append(num_output)
        offset += size
    sizes_np = np.asarray(sizes, dtype=np.int64)
    token_ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    starts = np.cumsum(sizes_np) - sizes_np
    position_in_row = np.arange(offset, dtype=np.int64) - np.repeat(starts, sizes_np)
    is_output = (position_in_row < np.repeat(np.asarray(num_outputs), sizes_np)).astype(np.float32)
    params = [seq.params for _, seq in penalized]
    return PenaltyInputs(
        rows=_put(np.repeat(np.asarray(rows, dtype=np.int64), sizes_np), torch.int64, device),
        local_rows=_put(
            np.repeat(np.asarray(local_rows, dtype=np.int64), sizes_np), torch.int64, device
        ),
        token_ids=_put(token_ids, torch.int64, device),
        is_output=_put(is_output, torch.float32, device),
        pending_positions=_put(pending_positions, torch.int64, device) if pending_rows else None,
        pending_rows=_put(pending_rows, torch.int64, device) if pending_rows else None,
        penalties=_put(
            np.repeat(
                np.asarray(
                    [
                        (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                        for p in params
                    ],
                    dtype=np.float32,
                ).T,
                sizes_np,
                axis=1,
            ),
            torch.float32,
            device,
        ),
        num_penalized=len(penalized),
    )


def _put(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device` (from pinned memory on CUDA: no wait)."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host
