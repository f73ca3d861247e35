"""Python side of paged_attention.c: attention over the paged KV cache for every query
token of a step, and storing a step's keys and values into the cache."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import native_library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

# Shapes the attention kernel takes (paged_attention.c: head_dim and block_size bound its
# scratch, and one tile holds at most 48 query rows, so at most 48 heads per kv head).
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256
MAX_HEADS_PER_KV_HEAD = 48


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_library()
    return None if lib is None else _declare(lib)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the attention functions of lib their C signatures."""
    attention = lib.tm_paged_attention
    attention.restype = ctypes.c_int
    attention.argtypes = [_ptr] * 10 + [_i64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    write = lib.tm_write_kv_cache
    write.restype = None
    write.argtypes = [_ptr] * 6 + [_i64] * 4 + [ctypes.c_int, ctypes.c_int]
    return lib


def native_attention_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `native_paged_attention` runs for tensors on device in dtype."""
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _library() is not None
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
    lib = _library()
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
    _library().tm_write_kv_cache(
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
