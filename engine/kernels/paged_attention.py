"""Python side of paged_attention.c: attention over the paged KV cache for every query
token of a step, and storing a step's keys and values into the cache."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import NativeLibrary, native_library
from tokenmill.engine.kernels.interface import AttentionArgs, KVWriteArgs, check_status


@functools.cache
def _library() -> NativeLibrary | None:
    return native_library()


def native_attention_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `native_paged_attention` runs for tensors on device in dtype."""
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _library() is not None
    )


def native_attention_fits(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> bool:
    """Whether the kernel takes a model of this attention shape with this block size
    (kernels.h's limits); others use the portable path."""
    limits = _library().limits
    return (
        head_dim <= limits.max_head_dim
        and block_size <= limits.max_block_size
        and num_heads // num_kv_heads <= limits.max_heads_per_kv_head
    )


def stores_pairs(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether the native kernels keep a cache of this kind in bf16 dot products' pair
    layout rather than the plain one (kernels.h, tm_write_kv_cache). Only they read and
    write such a cache; the engine picks one attention path per model."""
    native = _library()
    return (
        native is not None
        and dtype == torch.bfloat16
        and bool(native.lib.tm_stores_bf16_pairs(block_size, head_dim))
    )


def kv_int8_head_bytes(head_dim: int, block_size: int) -> int:
    """Bytes of one kv head's block in an int8 cache: its int8 values, then one fp32 scale
    per position and group of `kv_int8_group` values (kv_int8.h)."""
    group = _library().limits.kv_int8_group
    if head_dim % group:
        raise ValueError(
            f"an int8 KV cache needs head_dim to be a multiple of {group}; this model's is "
            f"{head_dim}"
        )
    return block_size * head_dim + block_size * (head_dim // group) * 4


def _int8_block_size(cache: torch.Tensor, head_dim: int) -> int:
    """The block size of an int8 cache [num_blocks, num_kv_heads, head bytes]."""
    per_position = kv_int8_head_bytes(head_dim, 1)
    if cache.dim() != 3 or cache.shape[2] % per_position:
        raise ValueError(
            f"an int8 cache is [num_blocks, num_kv_heads, head bytes]; got {tuple(cache.shape)}"
        )
    return cache.shape[2] // per_position


def _cache_shape(v_cache: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(num_kv_heads, block_size, kv_int8) of a value cache."""
    if v_cache.dtype == torch.int8:
        return v_cache.shape[1], _int8_block_size(v_cache, head_dim), 1
    return v_cache.shape[1], v_cache.shape[2], 0


def to_native_layout(
    k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-layout caches (keys [blocks, kv_heads, head_dim, block_size], values
    [blocks, kv_heads, block_size, head_dim]) as the native kernels keep them: the same
    tensors where that is the plain layout, else copies in the pair layout (same shapes).
    For tests and benchmarks that fill a cache themselves."""
    blocks, heads, head_dim, block_size = k_cache.shape
    if not stores_pairs(k_cache.dtype, block_size, head_dim):
        return k_cache, v_cache
    k = k_cache.reshape(blocks, heads, head_dim // 2, 2, block_size).transpose(-1, -2)
    v = v_cache.reshape(blocks, heads, block_size // 2, 2, head_dim).transpose(-1, -2)
    return (
        k.contiguous().view(k_cache.shape),
        v.contiguous().view(v_cache.shape),
    )


@dataclass
class AttentionEntries:
    """A step's query tokens as the native kernel takes them (see paged_attention.c).

    Each entry is one sequence's chunk of query tokens: a decoding sequence's one token,
    or a prompt chunk. Token i of an entry sits at position contexts - queries + i and
    sees the positions up to its own (the last `sliding_window` of them, if given).
    Entries come in groups: a group of one is a chunk
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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every query token of a step, straight over the paged cache. The
    entries' own keys and values must already be in the cache.

    Args:
        q: [num_tokens, num_heads, head_dim] (fp32 or bf16, CPU)
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size], q's dtype; or int8
            [num_blocks, num_kv_heads, kv_int8_head_bytes] (an int8 cache)
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype; or int8
            like k_cache
        sliding_window: a query at position p sees positions > p - window; None = all.
        sinks: [num_heads] a logit per query head added to its softmax's denominator
            with no value (gpt-oss's attention sinks); None: none.
    Returns:
        [num_tokens, num_heads, head_dim]; rows no entry covers are left unset.
    """
    if not native_attention_supports(q.device, q.dtype):
        raise RuntimeError(f"no native attention kernel for {q.dtype} on {q.device}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(
            f"sliding_window must be a positive number of tokens, not {sliding_window}"
        )
    native = _library()
    q = q.contiguous()
    out = torch.empty_like(q)
    _num_tokens, num_heads, head_dim = q.shape
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.int8):
        raise ValueError("the caches must both be int8 or both have q's dtype")
    num_kv_heads, block_size, kv_int8 = _cache_shape(v_cache, head_dim)
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(
                f"sinks must be one per query head ({num_heads}), not {tuple(sinks.shape)}"
            )
        sinks = sinks.detach().float().contiguous()  # kept alive until the call returns
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
    args = AttentionArgs(
        q=q.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        out=out.data_ptr(),
        rows=entries.rows.data_ptr(),
        queries=entries.queries.data_ptr(),
        contexts=entries.contexts.data_ptr(),
        block_tables=entries.block_tables.data_ptr(),
        group_starts=entries.group_starts.data_ptr(),
        group_shared_blocks=entries.group_shared_blocks.data_ptr(),
        sinks=None if sinks is None else sinks.data_ptr(),
        num_groups=entries.group_shared_blocks.shape[0],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks=entries.block_tables.shape[1],
        sliding_window=sliding_window or 0,
        scale=scale,
        is_bf16=int(q.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        kv_int8=kv_int8,
    )
    status = native.lib.tm_paged_attention(ctypes.byref(args))
    limits = native.limits
    check_status(
        status,
        f"attention takes head_dim <= {limits.max_head_dim}, block_size <= "
        f"{limits.max_block_size} and up to {limits.max_heads_per_kv_head} query heads per "
        f"kv head; got head_dim {head_dim}, block_size {block_size}, "
        f"{num_heads // num_kv_heads} heads per kv head"
        + (f"; int8 caches need head_dim a multiple of {limits.kv_int8_group}" if kv_int8 else ""),
    )
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store each token's key and value in its cache slot, in the cache's layout
    (quantized, for an int8 cache).

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype (fp32 or bf16 for an
            int8 cache: the dtype attention will compute in)
        k_cache: [num_blocks, num_kv_heads, head_dim, block_size], or an int8 cache
        v_cache: [num_blocks, num_kv_heads, block_size, head_dim], or an int8 cache
        slot_blocks, slot_offsets: [num_tokens] int64, block and offset in it
    """
    if not native_attention_supports(k.device, k.dtype):
        raise RuntimeError(f"no native kernels for {k.dtype} on {k.device}")
    if (
        k.dtype != v.dtype
        or k_cache.dtype != v_cache.dtype
        or k_cache.dtype
        not in (
            k.dtype,
            torch.int8,
        )
    ):
        raise ValueError("keys and values must have the cache's dtype (or it must be int8)")
    k, v = k.contiguous(), v.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    _heads, block_size, kv_int8 = _cache_shape(v_cache, head_dim)
    args = KVWriteArgs(
        k=k.data_ptr(),
        v=v.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        slot_blocks=slot_blocks.data_ptr(),
        slot_offsets=slot_offsets.data_ptr(),
        num_tokens=num_tokens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        is_bf16=int(k.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        kv_int8=kv_int8,
    )
    check_status(_library().lib.tm_write_kv_cache(ctypes.byref(args)), "kv cache write")
