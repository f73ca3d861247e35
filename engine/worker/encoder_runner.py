"""Runs one batch of whole sequences through an encoder and pools them.

An encoder (the BERT family) keeps no KV cache and samples nothing, so a batch is
simply its sequences packed back to back - no padding - with each token's position
within its sequence, its token type, and the per-batch attention object
(`encoder_attention.PackedAttention`). The loop that forms the batches is
`core/encoder_engine.py`.

Token types: a single text is segment 0 throughout. A rerank request is a (query,
document) pair laid out by the tokenizer's pair template ("[CLS] query [SEP] document
[SEP]"); its tokens after the first separator are segment 1, as the tokenizer's type
ids give them. The pair tokenizer refuses a query that itself holds the separator
(`loader/pooling_tokenizer.py`), so the first separator is always the template's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from tokenmill.engine.pooling.pooler import Pooler
from tokenmill.engine.types.pooling_params import RERANK, PoolingParams
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.worker.encoder_attention import PackedAttention


class EncoderRunner:
    """Executes encoder batches (`core.encoder_engine.EncoderBatchRunner`).

    Args:
        model: a loaded encoder (`models/bert.py`).
        pooler: its pooling.
        device: where it runs.
        pair_separator_id: the token that ends a pair's first segment (the tokenizer's
            pair template); None when the tokenizer has no pair template.
    """

    def __init__(
        self,
        model: nn.Module,
        pooler: Pooler,
        *,
        device: torch.device,
        dtype: torch.dtype,
        pair_separator_id: int | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.pooler = pooler
        self.device = device
        self.dtype = dtype
        self.pair_separator_id = pair_separator_id
        self._uses_token_types = getattr(model.config, "type_vocab_size", 1) > 1
        self.profiler: StepProfiler = NO_PROFILER  # tools install one: engine/types/profiling.py

    def unsupported(self, params: PoolingParams) -> str | None:
        """Why this model cannot serve params, or None."""
        problem = self.pooler.unsupported(params)
        if (
            problem is None
            and params.task == RERANK
            and self._uses_token_types
            and self.pair_separator_id is None
        ):
            return "the tokenizer has no pair template, so a pair's segments are unknown"
        return problem

    @torch.inference_mode()
    def run(
        self, token_ids: Sequence[Sequence[int]], params: Sequence[PoolingParams]
    ) -> list[torch.Tensor]:
        """Pool a batch of sequences.

        Args:
            token_ids: each sequence's tokens; sequences of equal length adjacent.
            params: each sequence's PoolingParams.

        Returns:
            One fp32 CPU tensor per sequence (`PoolingOutput.data`).
        """
        profiler = self.profiler
        with profiler.stage("prepare"):
            lengths = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))
            starts = np.cumsum(lengths) - lengths
            num_tokens = int(lengths.sum())
            flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, num_tokens)
            positions = np.arange(len(flat)) - np.repeat(starts, lengths)
            types = self._token_types(token_ids, params, starts, len(flat))
            inputs = (
                _to(flat, self.device),
                _to(positions, self.device),
                profiler.attention(PackedAttention(lengths.tolist())),
                None if types is None else _to(types, self.device),
            )
        with profiler.stage("forward"):
            hidden = self.model(*inputs)
        with profiler.stage("pool"):
            return self.pooler.pool_packed(hidden, lengths.tolist(), params)

    def _token_types(self, token_ids, params, starts, num_tokens) -> np.ndarray | None:
        """Each token's segment, or None when every token is segment 0."""
        pairs = [i for i, p in enumerate(params) if p.task == RERANK]
        if not self._uses_token_types or not pairs:
            return None
        types = np.zeros(num_tokens, np.int64)
        for i in pairs:
            ids = token_ids[i]
            try:
                second = list(ids).index(self.pair_separator_id) + 1
            except ValueError:
                continue  # one segment only: all of it is segment 0
            types[starts[i] + second : starts[i] + len(ids)] = 1
        return types


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)
