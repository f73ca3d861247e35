"""The default KV-cache format: keys and values in the model's own dtype, read by every
attention backend."""

from __future__ import annotations

import torch

from tokenmill.engine.models import ModelConfig
from tokenmill.engine.worker.kv_cache.format import CacheLayout, KVCacheFormat, register


class ModelDtypeFormat(KVCacheFormat):
    """Keys [head_dim, block_size] and values [block_size, head_dim] per kv head and
    block, in the dtype the model computes in (format.KVCache says why that layout)."""

    name = "auto"
    help = "the model's dtype"
    label = ""
    is_default = True

    def layout(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> CacheLayout:
        heads, dim = config.num_key_value_heads, config.head_dim
        layers = config.num_hidden_layers
        return (
            (layers, num_blocks, heads, dim, block_size),
            (layers, num_blocks, heads, block_size, dim),
            dtype,
        )


register(ModelDtypeFormat())
