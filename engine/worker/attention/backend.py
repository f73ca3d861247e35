"""The attention backend interface: what a backend says it supports, and the per-step
metadata it builds, through which a model's layers attend.

A backend is a class with a name, a check (`unsupported`) that says why it cannot serve
a model's attention - or None when it can - and `build`, which turns a step's flattened
tokens into the metadata every layer of that step shares. The metadata's `attend`
writes the layer's new keys and values into the cache and attends over it; the model
calls it and knows nothing of which backend built it. The runner picks one backend when
it starts (`select_backend`) and never branches on it again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from tokenmill.engine.core.step import SchedulerOutput
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.worker.kv_cache.format import KVCacheFormat


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention needs from a backend."""

    device: torch.device
    dtype: torch.dtype  # of queries, keys and values
    kv_format: KVCacheFormat  # how the cache holds them
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    attention_sinks: bool = False  # a learned logit per head in the softmax (gpt-oss)

    @classmethod
    def of_model(
        cls,
        config: ModelConfig,
        kv_format: KVCacheFormat,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> AttentionSpec:
        """What `config`'s attention needs, over a cache of `kv_format` blocks."""
        return cls(
            device=device,
            dtype=dtype,
            kv_format=kv_format,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            attention_sinks=config.attention_sinks,
        )

    @property
    def heads_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads


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


class AttentionBackend(ABC):
    """A way to attend over the paged KV cache (see the module docstring)."""

    name: ClassVar[str]
    # Whether decode-only steps may be captured as CUDA graphs (worker/cuda_graphs.py).
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether the cache it reads keeps bf16 blocks in a layout of its own (native kernels).
    owns_cache_layout: ClassVar[bool] = False
    # Whether its `attend` computes attention sinks (`StepAttention.attend`'s sinks).
    computes_sinks: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @classmethod
    @abstractmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot serve `spec` (None: it can). The KV-cache format is
        not its concern: each format names the backends that read it."""

    @abstractmethod
    def build(self, step: StepTokens, out: SchedulerOutput) -> StepAttention:
        """The step's metadata, uploaded to the device without waiting for it."""


def upload(array: np.ndarray | list[int], device: torch.device) -> torch.Tensor:
    """An int64 copy of array on the device, uploaded without waiting on CUDA."""
    return staged(array, device).to(device, non_blocking=True)


def staged(array: np.ndarray | list[int], device: torch.device) -> torch.Tensor:
    """array as an int64 host tensor to upload from: in pinned memory on CUDA, where a
    pageable source would make the copy synchronous. Pinned blocks come from torch's
    caching host allocator, which does not reuse one before its copy has run."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    return host.pin_memory() if device.type == "cuda" else host


def padded_block_tables(
    tables: list[list[int]], lengths: list[int], block_size: int, device: torch.device
) -> torch.Tensor:
    """[len(tables), max_blocks] block ids, padded with block 0 to the blocks the longest
    of `lengths` (one per table) needs."""
    max_blocks = -(-max(lengths) // block_size)
    padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for row, table in enumerate(tables):
        n = min(len(table), max_blocks)
        padded[row, :n] = table[:n]
    return upload(padded, device)
