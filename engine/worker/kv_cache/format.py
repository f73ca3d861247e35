"""The KV-cache format interface, the cache tensors it allocates, and the registry each
format joins.

A format is an object named by the `kv_cache_dtype` setting that says how many bytes a
block takes, lays out and allocates the cache's tensors, names the attention backends
that read it and refuses models it cannot hold. The runner keeps the allocated cache's
format beside its tensors, so nothing downstream asks the setting's string again.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill.engine.models import ModelConfig
from tokenmill.engine.worker.host_memory import lazy_zeros

# (k shape, v shape, element dtype) of a layer-stacked cache.
CacheLayout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


@dataclass
class KVCache:
    """The preallocated cache, all layers, and the format it is held in.

    Within a block each kv head's keys and values are contiguous, so attention reads
    one head's block as a single run of memory. Keys are also transposed,
    [head_dim, block_size], so a decode step scores a whole block of positions with
    contiguous vector loads and no horizontal sums; values stay token-major
    [block_size, head_dim], as the weighted sum wants. Where the native kernels attend
    to a bf16 cache with bf16 dot products they keep each block in those products'
    pair layout instead, same shapes (kernels/paged_attention.py, `stores_pairs`); only
    they read and write such a cache. Other formats lay their blocks out their own way
    (each format's module says how).
    """

    k: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, head_dim, block_size]
    v: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
    format: KVCacheFormat


class KVCacheFormat(ABC):
    """One way to store the KV cache (see the module docstring)."""

    name: ClassVar[str]  # the kv_cache_dtype value that selects it
    help: ClassVar[str]
    # Appended to a benchmark system's label ("tokenmill-bf16-kv8"); "" for the default.
    label: ClassVar[str]
    # The attention backends (`worker/attention/`, by name) that read it; None: every one.
    backends: ClassVar[tuple[str, ...] | None] = None
    # Whether a job gets this format without asking (exactly one format is the default).
    is_default: ClassVar[bool] = False

    def unsupported(self, head_dim: int, block_size: int) -> str | None:
        """Why this format cannot hold a model with heads of `head_dim` values in blocks
        of `block_size` positions (None: it can)."""
        return None

    @abstractmethod
    def layout(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> CacheLayout:
        """The shapes of the key and value tensors and their element dtype, for a model
        computing in `dtype`."""

    def bytes_per_block(self, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across every layer, keys and values."""
        k_shape, v_shape, element = self.layout(config, 1, block_size, dtype)
        return (math.prod(k_shape) + math.prod(v_shape)) * element.itemsize

    def allocate(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        huge_pages: bool,
    ) -> KVCache:
        """Zeroed keys and values for every layer (padding positions must never hold NaNs).

        On the CPU the memory is committed as blocks are first written
        (host_memory.lazy_zeros): a large budget costs nothing until the job uses it;
        `huge_pages` asks for it on 2 MiB pages.
        """
        k_shape, v_shape, element = self.layout(config, num_blocks, block_size, dtype)
        if device.type == "cpu":
            # Decode reads scattered blocks of this every step: on 2 MiB pages, not 4 KiB.
            return KVCache(
                k=lazy_zeros(k_shape, element, huge_pages=huge_pages),
                v=lazy_zeros(v_shape, element, huge_pages=huge_pages),
                format=self,
            )
        return KVCache(
            k=torch.zeros(k_shape, dtype=element, device=device),
            v=torch.zeros(v_shape, dtype=element, device=device),
            format=self,
        )

    def served_by(self, backend_name: str) -> bool:
        """Whether the attention backend called `backend_name` reads this format."""
        return self.backends is None or backend_name in self.backends


_FORMATS: dict[str, KVCacheFormat] = {}


def register(kv_format: KVCacheFormat) -> KVCacheFormat:
    """Make a format known by its name (its module calls this once)."""
    if kv_format.name in _FORMATS:
        raise ValueError(f"KV cache format {kv_format.name!r} is registered twice")
    _FORMATS[kv_format.name] = kv_format
    return kv_format


def registered() -> dict[str, KVCacheFormat]:
    """Every registered format by name, in registration order."""
    return dict(_FORMATS)
