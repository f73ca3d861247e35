"""Sizing and allocating the KV cache: one preallocated tensor of fixed-size blocks.

The cache holds keys and values in the model's dtype, or - with kv_cache_dtype "int8"
(CPU, native kernels) - as int8 with a scale per 32 values (kernels/kv_int8.h): 1.125
bytes a value instead of 2 (bf16) or 4 (fp32), so a budget holds 1.8x (3.6x) the tokens
and decoding reads that much less memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels.paged_attention import kv_int8_head_bytes
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.worker.attention import AttentionSpec, select_backend
from tokenmill.engine.worker.host_memory import lazy_zeros

# Without a budget, the CPU cache takes this share of RAM, capped below.
_CPU_RAM_SHARE = 0.10
_CPU_MAX_BYTES = 4 << 30
# On CUDA, this share of the memory free after loading the weights.
_CUDA_FREE_SHARE = 0.85


# The values kv_cache_dtype takes: the model's dtype, or int8 (CPU, native kernels).
KV_CACHE_DTYPES = ("auto", "int8")


def validate_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ValueError for a name that is not one of KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}"
        )


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    heads = 2 * config.num_hidden_layers * config.num_key_value_heads
    if kv_cache_dtype == "int8":
        return heads * kv_int8_head_bytes(config.head_dim, block_size)
    return heads * config.head_dim * block_size * torch.finfo(dtype).bits // 8


def check_kv_cache_dtype(
    kv_cache_dtype: str,
    config: ModelConfig,
    block_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Raise ValueError for a cache dtype no attention backend reads for this model, block
    size and device - before any weights load."""
    validate_kv_cache_dtype(kv_cache_dtype)
    select_backend(
        AttentionSpec(
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=block_size,
        )
    )


def kv_cache_dtype_of(cache: KVCache) -> str:
    """The kv_cache_dtype a cache was allocated with."""
    return "int8" if cache.k.dtype == torch.int8 else "auto"


def default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * _CUDA_FREE_SHARE)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(ram * _CPU_RAM_SHARE), _CPU_MAX_BYTES)


def num_blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
    kv_cache_dtype: str = "auto",
) -> int:
    block_bytes = bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({block_bytes} bytes each)"
        )
    return num_blocks


@dataclass
class KVCache:
    """The preallocated cache, all layers.

    Within a block each kv head's keys and values are contiguous, so attention reads
    one head's block as a single run of memory. Keys are also transposed,
    [head_dim, block_size], so a decode step scores a whole block of positions with
    contiguous vector loads and no horizontal sums; values stay token-major
    [block_size, head_dim], as the weighted sum wants. Where the native kernels attend
    to a bf16 cache with bf16 dot products they keep each block in those products'
    pair layout instead, same shapes (kernels/paged_attention.py, `stores_pairs`); only
    they read and write such a cache. An int8 cache is int8 tensors [num_layers,
    num_blocks, num_kv_heads, bytes a kv head's block takes], each such block its values
    (at the positions of the float layout) followed by their scales (kernels/kv_int8.h).
    """

    k: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, head_dim, block_size]
    v: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    *,
    huge_pages: bool = False,
) -> KVCache:
    """Zeroed keys and values for every layer (padding positions must never hold NaNs).

    On the CPU the memory is committed as blocks are first written (host_memory.lazy_zeros):
    a large budget costs nothing until the job uses it.
    """
    heads, dim = config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    if kv_cache_dtype == "int8":
        dtype = torch.int8
        k_shape = v_shape = (layers, num_blocks, heads, kv_int8_head_bytes(dim, block_size))
    else:
        k_shape = (layers, num_blocks, heads, dim, block_size)
        v_shape = (layers, num_blocks, heads, block_size, dim)
    if device.type == "cpu":
        # Decode reads scattered blocks of this every step: on 2 MiB pages, not 4 KiB.
        return KVCache(
            k=lazy_zeros(k_shape, dtype, huge_pages=huge_pages),
            v=lazy_zeros(v_shape, dtype, huge_pages=huge_pages),
        )
    return KVCache(
        k=torch.zeros(k_shape, dtype=dtype, device=device),
        v=torch.zeros(v_shape, dtype=dtype, device=device),
    )
