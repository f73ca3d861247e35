"""The engine's settings (`EngineConfig`), declared once, and the dtype choice."""

from __future__ import annotations

import platform
from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

from tokenmill.engine import env

# The most sequences running at once where max_num_seqs is not set (the KV cache then
# decides, below this).
MAX_RUNNING_SEQS = 256

# Pillow's own decompression-bomb limit: its default Image.MAX_IMAGE_PIXELS (about 89.5M).
DEFAULT_MAX_IMAGE_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)

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
    """True when oneDNN runs bf16 matmuls on the CPU's own bf16 instructions (AVX512-BF16
    or AMX tiles). torch's own check (onednn_has_bf16) is True on any AVX-512 BW/VL/DQ
    CPU - Ice Lake, Cascade Lake, Skylake-SP - where oneDNN widens bf16 to fp32 and a
    prompt's matmul runs several times slower than fp32's (docs/design.md, "bf16 without
    AVX512-BF16"): there "auto" stays fp32. On x86 the CPU's bf16 instructions decide;
    elsewhere torch's answer stands."""
    if not onednn_has_bf16():
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    cpu = torch.cpu
    return any(
        getattr(cpu, name, lambda: False)()
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def onednn_has_bf16() -> bool:
    """True when oneDNN takes bf16 here at all - reorders (packs) bf16 weights and runs bf16
    matmuls, natively or by widening to fp32 (torch's check: AVX-512 BW/VL/DQ,
    AVX-NE-CONVERT or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def setting(default: Any, help: str, *, job: bool = False) -> Any:
    """A field of EngineConfig: its default, its help text, and whether the job definition
    offers it as an option of its own (`job=True`; the rest are reachable through the
    `engine_options` job option)."""
    return field(default=default, metadata={"help": help, "job": job})


@dataclass
class EngineConfig:
    """The engine's settings, declared once: each field is a keyword of `LLM(...)` (its
    help text is LLM's documentation of it), and a field marked `job=True` is also an
    option of every job surface (pipelines/options.py derives those entries).

    How to add an engine setting
    ----------------------------
    Add one field with `setting(default, help)`, check its value in `__post_init__`, and
    read `config.<name>` where it matters. `LLM(name=...)`, help(LLM), the shared engine
    cache's key and `--engine-option name=...` follow; `job=True` makes it a job option
    too. A setting whose choices are registered elsewhere (quantization modes, KV cache
    dtypes) is checked against them by `worker/build.check_settings`, before any model is
    looked up.
    """

    dtype: str | torch.dtype = setting(
        "auto",
        "Model dtype: auto (bf16 on CUDA and on CPUs with native bf16, else fp32), "
        "float32 or bfloat16.",
        job=True,
    )
    device: str | torch.device | None = setting(
        None, "cpu, cuda, cuda:N (default: CUDA when available).", job=True
    )
    quantization: str | None = setting(
        None,
        "Run the model's linear layers quantized (CPU): int8 (int8 weights and "
        "activations), int4 (group-wise 4-bit weights) or gguf (a GGUF's own blocks).",
        job=True,
    )
    quantize_lm_head: bool = setting(
        False,
        "With quantization='int8' or 'gguf', run the lm_head in int8 too, smoothed as "
        "int8's layers are: the largest weight a one-sequence decode step reads, 11-13% "
        "faster there, at about +0.5% perplexity (+2.2% with an int8 KV cache, past "
        "int8's 2%, which is why it is off by default).",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache storage (CPU): auto (the model's dtype) or int8 (a scale per 32 values: "
        "1.8x the tokens of a bf16 cache in the same memory, half the bytes to read per "
        "decode step).",
        job=True,
    )
    kv_cache_memory: int | None = setting(
        None,
        "KV cache budget in bytes (default: sized from the device - a share of free GPU "
        "memory, or of RAM - and never more than max_num_seqs sequences at full context "
        "can fill). CPU memory is committed as blocks are first used.",
    )
    enable_prefix_caching: bool = setting(
        True, "Share computed prompt blocks between requests (a prefix is computed once)."
    )
    block_size: int = setting(16, "Tokens per KV cache block.")
    max_num_batched_tokens: int = setting(
        2048, "Tokens computed per engine step at most (prompt chunks and decodes together)."
    )
    max_num_seqs: int | None = setting(
        None,
        f"Sequences running at once at most (default: as many as the KV cache holds at "
        f"each one's prompt + max_tokens, so none is ever preempted, up to "
        f"{MAX_RUNNING_SEQS}). Set, sequences are admitted while their prompt fits and "
        f"the newest is preempted (recomputed later) when the cache runs out.",
    )
    max_model_len: int | None = setting(
        None, "The longest sequence served (default and maximum: the model's context)."
    )
    seed: int = setting(0, "Seed of sampled rows that have no seed of their own.")
    overlap_steps: bool | None = setting(
        None,
        "Launch each step before the previous step's sampled tokens reach the host "
        "(default: on CUDA).",
    )
    cuda_graphs: bool | None = setting(
        None, "Replay decode-only steps from CUDA graphs (default: on CUDA with Triton)."
    )
    packed_linear: bool | None = setting(
        None,
        "CPU float linear layers on weights packed once for oneDNN; False: F.linear "
        "(default: TOKENMILL_PACKED_LINEAR, on).",
    )
    max_loras: int = setting(
        8,
        "LoRA adapters whose weights are ready for a step at once (slots): the sequences "
        "running together use at most this many distinct adapters; others wait, and an "
        "adapter out of a slot stays loaded in host memory.",
    )
    max_lora_rank: int = setting(
        64, "The largest LoRA rank an adapter may have (its r, per layer)."
    )
    max_image_pixels: int = setting(
        DEFAULT_MAX_IMAGE_PIXELS,
        "The most pixels an image may have (width x height, read from its header before "
        "it is decoded); a larger one, a decompression bomb included, is refused. Default: "
        "Pillow's MAX_IMAGE_PIXELS.",
    )
    max_images_ahead: int = setting(
        16,
        "Images given as bytes decoded ahead of the scheduler's need, at most, beside the "
        "loop (engine/core/image_prefetch.py): the pixels held at once beyond one step's "
        "images. More keeps a fast tower fed past slow decodes; fewer holds less memory.",
    )
    image_decode_threads: int = setting(
        2, "Threads decoding and resizing images beside the loop (the decode pool)."
    )
    pan_and_scan: bool | None = setting(
        None,
        "Gemma 3: show a wide or tall image to the tower as itself and as crops along its "
        "long side (each as many soft tokens more as the image), as transformers' "
        "do_pan_and_scan; True or "
        "False overrides the model's image-processor config (default: as it says, off "
        "where null). Refused for models without pan-and-scan (Qwen2.5-VL, text models).",
    )
    huge_pages: bool | None = setting(
        None,
        "Ask Linux for 2 MiB pages for the CPU KV cache (default: TOKENMILL_HUGE_PAGES, "
        "off: where the kernel compacts memory to find a huge page, each first touch of "
        'one can stall for milliseconds - docs/design.md, "The KV cache").',
    )

    def __post_init__(self) -> None:
        # The environment gives the defaults of these; what is given wins.
        if self.packed_linear is None:
            self.packed_linear = env.PACKED_LINEAR.is_on()
        if self.huge_pages is None:
            self.huge_pages = env.HUGE_PAGES.is_on()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_images_ahead < 1:
            raise ValueError(f"max_images_ahead must be >= 1, got {self.max_images_ahead}")
        if self.image_decode_threads < 1:
            raise ValueError(f"image_decode_threads must be >= 1, got {self.image_decode_threads}")
        if not (self.pan_and_scan is None or isinstance(self.pan_and_scan, bool)):
            raise ValueError(f"pan_and_scan must be true, false or None, got {self.pan_and_scan!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(_DTYPES)}")

    @property
    def seq_cap(self) -> int:
        """The most sequences running at once: max_num_seqs, or MAX_RUNNING_SEQS where
        the KV cache decides (`derives_running_seqs`)."""
        return MAX_RUNNING_SEQS if self.max_num_seqs is None else self.max_num_seqs

    @property
    def derives_running_seqs(self) -> bool:
        """Whether sequences are admitted only while the KV cache holds every running one
        at its prompt + max_tokens (max_num_seqs not set; core/scheduler.py)."""
        return self.max_num_seqs is None


def engine_settings() -> tuple[Field, ...]:
    """EngineConfig's fields, in declaration order (help text in `.metadata["help"]`)."""
    return fields(EngineConfig)
