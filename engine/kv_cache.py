"""Sizing and allocating the KV cache: one preallocated tensor of fixed-size blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.config import ModelConfig

# Without a budget, the CPU cache takes this share of RAM, capped below.
_CPU_RAM_SHARE = 0.10
_CPU_MAX_BYTES = 4 << 30
# On CUDA, this share of the memory free after loading the weights.
_CUDA_FREE_SHARE = 0.85


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.finfo(dtype).bits // 8


def default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * _CUDA_FREE_SHARE)
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(ram * _CPU_RAM_SHARE), _CPU_MAX_BYTES)


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({bytes_per_block(config, block_size, dtype)} bytes each)"
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
    they read and write such a cache.
    """

    k: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, head_dim, block_size]
    v: torch.Tensor  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim]


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Zeroed keys and values for every layer (padding positions must never hold NaNs)."""
    heads, dim = config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    return KVCache(
        k=torch.zeros(layers, num_blocks, heads, dim, block_size, dtype=dtype, device=device),
        v=torch.zeros(layers, num_blocks, heads, block_size, dim, dtype=dtype, device=device),
    )
