"""Native CPU kernels, compiled on first use with the system C compiler.

The shared library is built once per machine into the tokenmill cache (keyed by the
source, the flags and the CPU) and loaded with ctypes; it links nothing from torch, so
it builds in about a second. When no compiler is available the engine falls back to
its pure-PyTorch path, which computes the same thing with gathered copies.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path(source: str) -> Path:
    from tokenmill.engine.model_files import cache_dir

    key = hashlib.sha256("\0".join([source, *_FLAGS, _cpu_fingerprint()]).encode()).hexdigest()
    return cache_dir() / "kernels" / f"paged_attention-{key[:16]}.so"


def _compile(source_path: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(source_path), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)  # atomic: concurrent builders never see half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def paged_attention_library() -> ctypes.CDLL | None:
    """The compiled decode-attention kernel, or None when it cannot be built here."""
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") == "0":
        return None
    source_ref = resources.files(__name__).joinpath("paged_attention.c")
    try:
        with resources.as_file(source_ref) as source_path:
            target = _library_path(source_path.read_text())
            if not target.exists():
                _compile(source_path, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native attention kernel unavailable, using the PyTorch path: %s", detail)
        return None
    fn = lib.tm_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 6
        + [ctypes.c_int64] * 6
        + [
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
        ]
    )
    return lib


def decode_kernel_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `paged_decode_attention` runs natively for tensors on device in dtype."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and paged_attention_library() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor | None:
    """One query token per sequence over the paged cache; None if the kernel is missing.

    Args:
        q: [num_seqs, num_heads, head_dim] (fp32 or bf16, CPU)
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size], q's dtype
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
        block_tables: [num_seqs, max_blocks] int64
        context_lens: [num_seqs] int64
    Returns:
        [num_seqs, num_heads, head_dim]
    """
    if not decode_kernel_supports(q.device, q.dtype):
        return None
    lib = paged_attention_library()
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = lib.tm_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        v_cache.shape[1],  # num_kv_heads
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(
            f"the native attention kernel supports block_size <= 256, got {block_size}"
        )
    if status != 0:
        raise MemoryError("native attention kernel could not allocate its scratch buffers")
    return out
