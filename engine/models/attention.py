"""The attention interfaces a model's layers call, declared here once: the worker's
attention backends implement them (`worker/attention/` for decoders over the paged KV
cache, `worker/encoder_attention.py` for encoders), and a model never knows which one
it was handed."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class StepAttention(ABC):
    """One step's attention metadata, built once by a backend and shared by all layers,
    passed down through the model's forward."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's keys and values into the layer's cache, then attend.

        Args:
            q: [num_tokens, num_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
            k_cache: [num_blocks, num_kv_heads, head_dim, block_size] (worker/kv_cache/)
            v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
            sliding_window: the layer's window: a query at position p sees the keys at
                positions (p - sliding_window, p], as transformers masks Mistral's and
                Gemma 3's local layers; None sees every earlier position.
            sinks: [num_heads] fp32, one logit per query head that joins its softmax's
                denominator with no value (gpt-oss); None: none. Only the backends that
                say they compute them (`AttentionBackend.computes_sinks`) are given them.
        Returns:
            [num_tokens, num_heads, head_dim]
        """


class BidirectionalAttention(ABC):
    """A batch's attention over its packed sequences, shared by all of an encoder's
    layers."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q, k, v: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim];
        each token attends over every token of its own sequence."""
