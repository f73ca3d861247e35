"""The engine's settings (`EngineConfig`) and the dtype choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a user's dtype choice to a torch dtype; "auto" picks per device.

    On CUDA "auto" is bf16. On CPU it is fp32 unless the CPU has native bf16 matmuls.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN can run bf16 matmuls natively (AVX512_BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass
class EngineConfig:
    """Knobs of the serving engine, validated on construction.

    kv_cache_memory is the KV cache budget in bytes; None sizes it from the device
    (a fraction of free GPU memory, or a fixed CPU default). kv_cache_dtype: "auto" (the
    model's dtype) or "int8" (kv_cache.py). quantization: see engine/quant/__init__.py.
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # None, or how the linear layers hold their weights: "int8", "int4", "gguf" (quant/)
    quantization: str | None = None
    # Launch each step before resolving the previous one's sampled tokens (None: on CUDA).
    overlap_steps: bool | None = None
    # Replay decode-only steps from CUDA graphs (None: on CUDA when Triton is installed).
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        from tokenmill.engine.quant import validate_name

        validate_name(self.quantization)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        from tokenmill.engine.worker.kv_cache import validate_kv_cache_dtype

        validate_kv_cache_dtype(self.kv_cache_dtype)
