"""Native CPU kernels, compiled on first use with the system C compiler.

Every .c file here is built into one shared library, once per machine, in the
tokenmill cache (keyed by the sources, the flags and the CPU), and loaded with ctypes;
it links nothing from torch, so it builds in a few seconds. When no compiler is
available the engine falls back to its pure-PyTorch paths, which compute the same
things (attention with gathered copies of the cache).
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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: with it GCC (before 13) links crtfastmath.o into the
# library, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process the moment the library loads - changing the user's own float arithmetic.
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path(sources: dict[str, str]) -> Path:
    from tokenmill.engine.model_files import cache_dir

    parts = [f"{name}\0{text}" for name, text in sorted(sources.items())]
    flags = [*_COMPILE_FLAGS, *_LINK_FLAGS]
    key = hashlib.sha256("\0".join([*parts, *flags, _cpu_fingerprint()]).encode()).hexdigest()
    return cache_dir() / "kernels" / f"tokenmill-kernels-{key[:16]}.so"


def _compile(source_dir: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Build every .c file in source_dir into one shared library at target (tests add
    flags to build the paths other CPUs take)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            object_files = []
            for source in _c_files(source_dir):
                obj = Path(objects) / f"{source.stem}.o"
                _run([compiler, *_COMPILE_FLAGS, *extra_flags, "-c", str(source), "-o", str(obj)])
                object_files.append(str(obj))
            _run([compiler, *_LINK_FLAGS, *object_files, "-o", tmp, "-lm"])
        os.replace(tmp, target)  # atomic: concurrent builders never see half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _c_files(source_dir: Path) -> list[Path]:
    return sorted(source_dir.glob("*.c"))


def _sources(source_dir: Path) -> dict[str, str]:
    """Every C source and header the library is built from, by file name."""
    files = [*_c_files(source_dir), *sorted(source_dir.glob("*.h"))]
    return {path.name: path.read_text() for path in files}


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled native kernels, or None when they cannot be built here."""
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        with resources.as_file(resources.files(__name__)) as source_dir:
            target = _library_path(_sources(source_dir))
            if not target.exists():
                _compile(source_dir, target)
        return _load(target)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native kernels unavailable, using the PyTorch paths: %s", detail)
        return None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.tm_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    )
    write = lib.tm_write_kv_cache
    write.restype = None
    write.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    return lib


# Shapes the attention kernel takes (paged_attention.c: head_dim and block_size bound its
# scratch, and one tile holds at most 48 query rows, so at most 48 heads per kv head).
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256
MAX_HEADS_PER_KV_HEAD = 48


def native_attention_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `native_paged_attention` runs for tensors on device in dtype."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and native_library() is not None
    )


def native_attention_fits(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bool:
    """Whether the kernel takes a model of this attention shape with this block size;
    others use the portable path."""
    return (
        head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK_SIZE
        and num_heads // num_kv_heads <= MAX_HEADS_PER_KV_HEAD
    )


@dataclass
class AttentionEntries:
    """A step's query tokens as the native kernel takes them (see paged_attention.c).

    Each entry is one sequence's chunk of query tokens: a decoding sequence's one token,
    or a prompt chunk. Token i of an entry sits at position contexts - queries + i and
    sees the positions up to its own. Entries come in groups: a group of one is a chunk
    on its own; a larger group holds decoding sequences whose first `group_shared_blocks`
    cache blocks are the same blocks, read once for all of them.
    """

    rows: torch.Tensor  # [num_entries] the entry's first token in the flat batch
    queries: torch.Tensor  # [num_entries] its query tokens
    contexts: torch.Tensor  # [num_entries] positions its last token sees, itself included
    block_tables: torch.Tensor  # [num_entries, max_blocks] its context's blocks, 0-padded
    group_starts: torch.Tensor  # [num_groups + 1] the entries of group k: [starts[k], starts[k+1])
    group_shared_blocks: torch.Tensor  # [num_groups]


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    entries: AttentionEntries,
    scale: float,
) -> torch.Tensor:
    """Attention for every query token of a step, straight over the paged cache. The
    entries' own keys and values must already be in the cache.

    Args:
        q: [num_tokens, num_heads, head_dim] (fp32 or bf16, CPU)
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size], q's dtype
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
    Returns:
        [num_tokens, num_heads, head_dim]; rows no entry covers are left unset.
    """
    if not native_attention_supports(q.device, q.dtype):
        raise RuntimeError(f"no native attention kernel for {q.dtype} on {q.device}")
    lib = native_library()
    q = q.contiguous()
    out = torch.empty_like(q)
    _num_tokens, num_heads, head_dim = q.shape
    _num_blocks, num_kv_heads, block_size, _ = v_cache.shape
    tensors = (
        entries.rows,
        entries.queries,
        entries.contexts,
        entries.block_tables,
        entries.group_starts,
        entries.group_shared_blocks,
    )
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise ValueError("attention entries must be contiguous int64 tensors")
    status = lib.tm_paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        *(t.data_ptr() for t in tensors),
        entries.group_shared_blocks.shape[0],  # num_groups
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        entries.block_tables.shape[1],
        scale,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(
            "the native attention kernel supports head_dim <= 256, block_size <= 256 and up "
            f"to 48 query heads per kv head; got head_dim {head_dim}, block_size "
            f"{block_size}, {num_heads // num_kv_heads} heads per kv head"
        )
    if status != 0:
        raise MemoryError("native attention kernel could not allocate its scratch buffers")
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store each token's key and value in its cache slot, in the cache's layout.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
        slot_blocks, slot_offsets: [num_tokens] int64, block and offset in it
    """
    if not native_attention_supports(k.device, k.dtype):
        raise RuntimeError(f"no native kernels for {k.dtype} on {k.device}")
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError("keys and values must have the cache's dtype")
    k, v = k.contiguous(), v.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    native_library().tm_write_kv_cache(
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_blocks.data_ptr(),
        slot_offsets.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_dim,
        v_cache.shape[2],  # block_size
        int(k.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
