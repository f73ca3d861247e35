"""The KV cache: one preallocated tensor of fixed-size blocks per keys and values, held in
one of the registered formats (`kv_cache_dtype`), and sized from a memory budget.

The formats:

- "auto": the model's dtype (model_dtype.py), read by every attention backend.
- "int8": int8 with a scale per 32 values (int8.py), read by the native CPU kernels.

How to add a KV-cache format
----------------------------
Write one module here with a `KVCacheFormat` subclass (format.py): its `name` (the
`kv_cache_dtype` value), `help`, `label`, the attention `backends` that read it, an
`unsupported` that refuses head sizes or block sizes it cannot hold, and a `layout` of
its key and value tensors - then `register(YourFormat())` at the module's end. This
package imports every module in it, so the setting's choices, the check before loading,
the cache's sizing and allocation and the attention backend's choice follow with no
other edit (the backends it names must read its tensors).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import torch

from tokenmill.engine.models import ModelConfig
from tokenmill.engine.worker.kv_cache.format import KVCache, KVCacheFormat, registered

# Modules of this package that are not formats.
_NOT_FORMATS = frozenset({"format"})

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_FORMATS:
        importlib.import_module(f"{__name__}.{_module.name}")

# The values kv_cache_dtype takes, the default first.
KV_CACHE_DTYPES: tuple[str, ...] = tuple(
    sorted(registered(), key=lambda name: (not registered()[name].is_default, name))
)

# Without a budget, the CPU cache takes this share of RAM, capped below.
_CPU_RAM_SHARE = 0.10
_CPU_MAX_BYTES = 4 << 30
# On CUDA, this share of the memory free after loading the weights.
_CUDA_FREE_SHARE = 0.85


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat:
    """The format called `kv_cache_dtype`; raises ValueError naming the choices."""
    formats = registered()
    if kv_cache_dtype not in formats:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}"
        )
    return formats[kv_cache_dtype]


def default_kv_cache_format() -> KVCacheFormat:
    """The format a job gets without asking: the model's dtype."""
    return next(f for f in registered().values() if f.is_default)


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
    kv_format: KVCacheFormat,
) -> int:
    block_bytes = kv_format.bytes_per_block(config, block_size, dtype)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({block_bytes} bytes each)"
        )
    return num_blocks


__all__ = [
    "KV_CACHE_DTYPES",
    "KVCache",
    "KVCacheFormat",
    "default_cache_bytes",
    "default_kv_cache_format",
    "kv_cache_format",
    "num_blocks_for_budget",
]
