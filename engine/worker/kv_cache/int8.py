"""The int8 KV-cache format (CPU, native kernels): int8 values with an fp32 scale per 32,
1.125 bytes a value instead of 2 (bf16) or 4 (fp32), so a budget holds 1.8x (3.6x) the
tokens and decoding reads that much less memory.

Keys and values are int8 tensors [num_layers, num_blocks, num_kv_heads, bytes a kv
head's block takes], each such block its values (at the positions of the float layout)
followed by their scales (kernels/kv_int8.h). Only the native attention kernels read and
write it; they quantize as they store.
"""

from __future__ import annotations

import torch

from tokenmill.engine.kernels.paged_attention import kv_int8_head_bytes
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.worker.kv_cache.format import CacheLayout, KVCacheFormat, register


class Int8Format(KVCacheFormat):
    name = "int8"
    help = "int8 with a scale per 32 values (CPU, native kernels)"
    label = "kv8"
    backends = ("native",)

    def unsupported(self, head_dim: int, block_size: int) -> str | None:
        try:
            kv_int8_head_bytes(head_dim, block_size)
        except ValueError as error:
            return str(error)
        return None

    def layout(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> CacheLayout:
        shape = (
            config.num_hidden_layers,
            num_blocks,
            config.num_key_value_heads,
            kv_int8_head_bytes(config.head_dim, block_size),
        )
        return shape, shape, torch.int8


register(Int8Format())
