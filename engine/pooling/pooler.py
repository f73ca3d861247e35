"""Pooling: a sequence's final hidden states -> its embedding, class probabilities or score.

Two ways in, one arithmetic:
- the encoder runner has every sequence of a batch whole, packed back to back, and pools
  them at once (`Pooler.pool_packed`);
- a decoder's sequence runs through the decode loop in prompt chunks, so each chunk folds
  its rows into the sequence's running sums (`Pooler.record_step`) and the last one
  finishes it. A pooling that reads every token (mean, max, CLS ...) must see every
  row, so such a sequence may take from the prefix cache only what it has folded in
  (`PoolingState.reads_every_token`, the scheduler's cap - as for prompt log-probs);
  last-token pooling reads only the final row, which is always computed, so it shares
  cached prefixes freely.

Sums are kept in fp32 whatever the model's dtype, as sentence-transformers accumulates.
What follows the pooling, per request (`PoolingParams`): embed - unit-normalise if the
model says so (its Normalize module) or the request asks; with `dimensions`, keep the
first n values and normalise again. classify - the head's logits over the token it
reads (`model.head_pooling`), through softmax, or sigmoid for one label or multi-label
heads. rerank - the one-label head's logit through the model's activation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.core.step import PoolingState, ScheduledChunk
from tokenmill.engine.pooling.config import PoolingConfig
from tokenmill.engine.types.pooling_params import CLASSIFY, EMBED, RERANK, PoolingParams

# Modes that read every row of a sequence (the rest read one: its first or last token).
_EVERY_TOKEN = frozenset({"max", "mean", "mean_sqrt_len_tokens", "weightedmean"})
_HEAD_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda x: x, "tanh": torch.tanh}


def _modes(config: PoolingConfig, head_pooling: str | None, params: PoolingParams) -> tuple:
    if params.task == EMBED:
        return config.modes
    return (head_pooling or "cls",)


def reads_every_token(
    config: PoolingConfig, head_pooling: str | None, params: PoolingParams
) -> bool:
    """Whether a decoder's pooling of `params` reads rows before its last (mean, max,
    CLS ...): then the prefix cache may serve such a request only rows it has folded in
    - nothing at its first admission. Known from the model's files and class alone, so
    a forecast knows it before any weights load."""
    return bool(set(_modes(config, head_pooling, params)) & (_EVERY_TOKEN | {"cls"}))


@dataclass
class _Partial:
    """A decoder sequence's running pooling sums over the rows folded in so far."""

    sum: torch.Tensor | None = None  # fp32 [hidden]
    weighted_sum: torch.Tensor | None = None  # sum of (position + 1) * row
    max: torch.Tensor | None = None
    first: torch.Tensor | None = None  # rows in the model's dtype (a head's input)
    last: torch.Tensor | None = None


class Pooler:
    """The pooling of one loaded model: its modes and head, what a request may ask.

    Args:
        model: the loaded model; `head_pooling` ("cls" | "lasttoken" | None) and
            `classify(rows) -> logits` when it has a classification head.
        config: how the model pools (pooling/config.py).
        tasks: the tasks the model serves (registry TASKS).
    """

    def __init__(self, model: nn.Module, config: PoolingConfig, tasks: Seq[str]) -> None:
        self.model = model
        self.config = config
        self.tasks = tuple(tasks)
        self.head_pooling: str | None = getattr(model, "head_pooling", None)
        self.hidden_size: int = model.config.hidden_size
        self.num_labels: int = getattr(model.config, "num_labels", 0)

    @property
    def embedding_size(self) -> int:
        """Values in an embedding before any `dimensions` (the modes are concatenated)."""
        return self.hidden_size * len(self.config.modes)

    def unsupported(self, params: PoolingParams) -> str | None:
        """Why this model cannot serve params, or None."""
        if params.task not in self.tasks:
            served = ", ".join(self.tasks) or "nothing"
            return f"the model does not serve {params.task} requests (it serves {served})"
        if params.task == EMBED:
            if self.config.unsupported is not None:
                return f"the model cannot embed: {self.config.unsupported}"
            if params.dimensions is not None and params.dimensions > self.embedding_size:
                return (
                    f"dimensions={params.dimensions} is more than the model's "
                    f"{self.embedding_size}-value embedding"
                )
        if params.task == RERANK and self.num_labels != 1:
            return f"reranking needs a one-label head; this model's has {self.num_labels}"
        if params.task == RERANK and self.config.rerank_activation not in _HEAD_ACTIVATIONS:
            return f"unsupported cross-encoder activation {self.config.rerank_activation!r}"
        return None

    def state_for(self, params: PoolingParams) -> PoolingState:
        """A decoder request's pooling state (the loop carries it on the Sequence)."""
        return PoolingState(
            params, reads_every_token=reads_every_token(self.config, self.head_pooling, params)
        )

    def _modes(self, params: PoolingParams) -> tuple[str, ...]:
        return _modes(self.config, self.head_pooling, params)

    # -- whole sequences, packed (the encoder runner) ---------------------------------------

    @torch.inference_mode()
    def pool_packed(
        self, hidden: torch.Tensor, lengths: Seq[int], params: Seq[PoolingParams]
    ) -> list[torch.Tensor]:
        """Outputs of whole sequences packed back to back.

        Args:
            hidden: [num_tokens, hidden] the final hidden states, sequence after sequence.
            lengths: each sequence's tokens, in order.
            params: each sequence's PoolingParams.

        Returns:
            One fp32 CPU tensor per sequence (`PoolingOutput.data`).
        """
        device = hidden.device
        lens = torch.tensor(list(lengths), device=device)
        ends = torch.cumsum(lens, 0)
        starts = ends - lens
        modes = sorted({m for p in params for m in self._modes(p)})
        sums: dict[str, torch.Tensor] = {}
        if _EVERY_TOKEN & set(modes):
            rows = hidden.float()

            def segment(values: torch.Tensor, reduce: str) -> torch.Tensor:
                return torch.segment_reduce(values, reduce, lengths=lens, axis=0)

            if {"mean", "mean_sqrt_len_tokens"} & set(modes):
                sums["sum"] = segment(rows, "sum")
            if "weightedmean" in modes:
                position = torch.arange(hidden.shape[0], device=device)
                weight = (position - torch.repeat_interleave(starts, lens) + 1).float()
                sums["weighted_sum"] = segment(rows * weight[:, None], "sum")
            if "max" in modes:
                sums["max"] = segment(rows, "max")
        first, last = hidden[starts], hidden[ends - 1]
        n = lens.float()[:, None]
        pooled = {
            "cls": first.float(),
            "lasttoken": last.float(),
            "mean": sums["sum"] / n if "sum" in sums else None,
            "mean_sqrt_len_tokens": sums["sum"] / n.sqrt() if "sum" in sums else None,
            "weightedmean": (
                sums["weighted_sum"] / (n * (n + 1) / 2) if "weighted_sum" in sums else None
            ),
            "max": sums.get("max"),
        }
        return self._finish(pooled, first, last, params)

    # -- a decoder's prompt chunks (the decode loop) ---------------------------------------------

    @torch.inference_mode()
    def record_step(self, chunks: Seq[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Fold each pooling chunk's rows into its sequence; finish the sequences whose
        prompt this step completes (their `pooling.result` is set).

        Args:
            chunks: the step's chunks in the order their tokens are laid out in the batch
                (SchedulerOutput.chunks: decodes first).
            hidden: [num_tokens, hidden] the step's final hidden states.
        """
        finishing: list[tuple[PoolingState, int]] = []
        next_row = 0
        for chunk in chunks:
            row, next_row = next_row, next_row + chunk.num_new_tokens
            state = chunk.seq.pooling
            if state is None:
                continue
            start = chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            if state.reads_every_token:
                # Rows this sequence has folded in already (recomputed after a
                # preemption) are skipped: each position counts once.
                skip = max(0, state.num_pooled - start)
                self._fold(state, hidden[row + skip : row + chunk.num_new_tokens], start + skip)
                state.num_pooled = max(state.num_pooled, end)
            if end == chunk.seq.num_prompt_tokens:
                partial = state.partial or _Partial()
                partial.last = hidden[row + chunk.num_new_tokens - 1]
                state.partial = partial
                finishing.append((state, end))
        if finishing:
            self._finish_states(finishing)

    def _fold(self, state: PoolingState, rows: torch.Tensor, first_position: int) -> None:
        if rows.shape[0] == 0:
            return
        partial = state.partial or _Partial()
        state.partial = partial
        rows32 = rows.float()
        modes = set(self._modes(state.params))
        if first_position == 0:
            partial.first = rows[0]
        if {"mean", "mean_sqrt_len_tokens"} & modes:
            total = rows32.sum(0)
            partial.sum = total if partial.sum is None else partial.sum + total
        if "weightedmean" in modes:
            weight = torch.arange(
                first_position + 1, first_position + 1 + rows.shape[0], device=rows.device
            ).float()
            total = (rows32 * weight[:, None]).sum(0)
            partial.weighted_sum = (
                total if partial.weighted_sum is None else partial.weighted_sum + total
            )
        if "max" in modes:
            best = rows32.max(0).values
            partial.max = best if partial.max is None else torch.maximum(partial.max, best)

    def _finish_states(self, finishing: list[tuple[PoolingState, int]]) -> None:
        partials = [state.partial for state, _ in finishing]
        n = torch.tensor([float(length) for _, length in finishing])[:, None]
        last = torch.stack([p.last for p in partials])

        def stacked(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in partials]
            return None if any(v is None for v in values) else torch.stack(values).cpu()

        total, weighted = stacked("sum"), stacked("weighted_sum")
        first = stacked("first")
        pooled = {
            "cls": first.float() if first is not None else None,
            "lasttoken": last.float().cpu(),
            "mean": total / n if total is not None else None,
            "mean_sqrt_len_tokens": total / n.sqrt() if total is not None else None,
            "weightedmean": weighted / (n * (n + 1) / 2) if weighted is not None else None,
            "max": stacked("max"),
        }
        params = [state.params for state, _ in finishing]
        results = self._finish(pooled, first, last, params)
        for (state, _), result in zip(finishing, results):
            state.result = result
            state.partial = None

    # -- what follows the pooling ------------------------------------------------------------------

    def _finish(
        self,
        pooled: dict[str, torch.Tensor | None],
        first: torch.Tensor | None,
        last: torch.Tensor,
        params: Seq[PoolingParams],
    ) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [None] * len(params)
        embed = [i for i, p in enumerate(params) if p.task == EMBED]
        if embed:
            vectors = torch.cat([pooled[m][embed] for m in self.config.modes], dim=1).cpu()
            for row, i in enumerate(embed):
                results[i] = self._embedding(vectors[row], params[i])
        heads = [i for i, p in enumerate(params) if p.task in (CLASSIFY, RERANK)]
        if heads:
            rows = first if self.head_pooling == "cls" else last
            index = torch.tensor(heads, device=rows.device)
            logits = self.model.classify(rows.index_select(0, index)).float().cpu()
            for row, i in enumerate(heads):
                results[i] = self._head_output(logits[row], params[i])
        return results

    def _embedding(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, dim=0)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
            if normalize:
                vector = F.normalize(vector, dim=0)
        return vector.contiguous()

    def _head_output(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.task == RERANK:
            return _HEAD_ACTIVATIONS[self.config.rerank_activation](logits)
        if self.config.classify_activation == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=0)
