"""The native attention kernel against the portable PyTorch path, side by side.

    python benchmarks/attention_kernel.py

One layer of SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64, 16-token
blocks scattered over the cache) on two step shapes, fp32 and bf16:
- prefill: six prompt chunks of 5-948 tokens, some continuing cached context (1,100
  positions at most) - the portable path gathers each chunk's context and calls SDPA
  (fp32) or its batched-matmul attention (bf16) once per chunk;
- decode: 64 sequences, half sharing a 256-token prefix (mixed64's layout) - the
  portable path gathers every context and runs one padded SDPA.
Each case also runs the native kernel over an int8 KV cache (`kv_cache_dtype="int8"`) holding
the same values quantized. Best of 7 calls after a warm-up, alternating the paths; the
ratios are what to read.
--window N attends within a sliding window of N positions (Mistral's and Gemma 3's local
layers) on both paths. --layers N runs the decode case over N caches in turn, as a model's
N layers do: one cache's blocks fit a large L3 (this case reads ~12 MB of a 74 MB bf16
cache), N of them need not, and then the step reads memory, not cache.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from tokenmill.bench.timing import best_of

# Below the front door: a kernel micro-benchmark - it times the attention kernels and the
# portable path's own functions on hand-built caches, which no public API exposes.
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries,
    kv_int8_head_bytes,
    native_paged_attention,
    write_kv_cache,
)
from tokenmill.engine.worker.attention.portable import (
    PortableMetadata,
    PrefillSpan,
    _decode_attention,
    _prefill_span_attention,
)
from tokenmill.engine.worker.attention.shared_prefix import group_shared_prefixes

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PREFILL = [(512, 512), (256, 512), (300, 556), (948, 2048), (400, 400), (5, 261)]


def _int64(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=torch.int64)


class Layout:
    """Block tables over a cache of scattered blocks."""

    def __init__(self, dtype: torch.dtype, num_blocks: int = 6000) -> None:
        self.k = torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK).to(dtype)
        self.v = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)

    def table(self, positions: int, prefix: list[int] = ()) -> list[int]:
        return list(prefix) + [self.free.pop() for _ in range(-(-positions // BLOCK) - len(prefix))]

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same keys and values in int8 caches, through the native writer."""
        blocks = self.k.shape[0]
        shape = (blocks, KV_HEADS, kv_int8_head_bytes(HEAD_DIM, BLOCK))
        k8, v8 = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
        k = self.k.permute(0, 3, 1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
        v = self.v.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM)
        slots = torch.arange(blocks * BLOCK)
        write_kv_cache(k, v, k8, v8, slots // BLOCK, slots % BLOCK)
        return k8, v8


def _padded(tables: list[list[int]]) -> torch.Tensor:
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return torch.from_numpy(out)


def prefill_case(dtype, window=None):
    layout = Layout(dtype)
    rows, queries, contexts, tables, spans, row = [], [], [], [], [], 0
    for num_query, context in PREFILL:
        table = layout.table(context)
        rows.append(row), queries.append(num_query), contexts.append(context)
        tables.append(table)
        ids = _int64(table) if context > num_query else None
        spans.append(PrefillSpan(row, num_query, context, ids))
        row += num_query
    q = torch.randn(row, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(row, KV_HEADS, HEAD_DIM).to(dtype)  # this step's own keys and values
    v = torch.randn(row, KV_HEADS, HEAD_DIM).to(dtype)
    entries = AttentionEntries(
        _int64(rows),
        _int64(queries),
        _int64(contexts),
        _padded(tables),
        _int64(range(len(rows) + 1)),
        _int64([0] * len(rows)),
    )

    k8, v8 = layout.int8()

    def native():
        native_paged_attention(q, layout.k, layout.v, entries, HEAD_DIM**-0.5, window)

    def native_int8():
        native_paged_attention(q, k8, v8, entries, HEAD_DIM**-0.5, window)

    def portable():
        for span in spans:
            _prefill_span_attention(q, k, v, layout.k, layout.v, span, HEAD_DIM**-0.5, window)

    seen = sum(min(p + 1, window or p + 1) for n, c in PREFILL for p in range(c - n, c))
    flops = seen * 4 * HEAD_DIM * HEADS
    return native, portable, native_int8, flops


def decode_case(dtype, window=None, layers=1):
    layout = Layout(dtype)
    rng = random.Random(1)
    prefix = layout.table(256)
    lengths = [256 + rng.randint(64, 256) + 32 for _ in range(32)]
    lengths += [rng.randint(64, 512) + 32 for _ in range(32)]
    tables = [layout.table(n, prefix if i < 32 else ()) for i, n in enumerate(lengths)]
    q = torch.randn(len(lengths), HEADS, HEAD_DIM).to(dtype)
    groups, alone = group_shared_prefixes(
        [np.asarray(t) for t in tables], lengths, BLOCK, max_members=32
    )
    order = [i for g in groups for i in g.members] + alone
    starts = np.cumsum([0] + [len(g.members) for g in groups] + [1] * len(alone))
    entries = AttentionEntries(
        _int64(order),
        _int64([1] * len(order)),
        _int64([lengths[i] for i in order]),
        _padded([tables[i] for i in order]),
        _int64(starts),
        _int64([g.shared_blocks for g in groups] + [0] * len(alone)),
    )
    meta = PortableMetadata(
        slot_blocks=_int64([]),
        slot_offsets=_int64([]),
        num_decode_tokens=len(lengths),
        decode_block_tables=_padded(tables),
        decode_context_lens=_int64(lengths),
        prefills=[],
    )

    # The other layers' caches: the same block numbers (the same shuffled free list), other values.
    layouts = [layout] + [Layout(dtype) for _ in range(layers - 1)]
    int8_caches = [each.int8() for each in layouts]

    def native():
        for each in layouts:
            native_paged_attention(q, each.k, each.v, entries, HEAD_DIM**-0.5, window)

    def native_int8():
        for k8, v8 in int8_caches:
            native_paged_attention(q, k8, v8, entries, HEAD_DIM**-0.5, window)

    def portable():
        for each in layouts:
            _decode_attention(q, each.k, each.v, meta, HEAD_DIM**-0.5, window)

    # Positions read once a shared prefix is read once (or only each window's).
    read = sum(min(n, window) for n in lengths) if window else sum(lengths) - 31 * 256
    nbytes = read * KV_HEADS * HEAD_DIM * 2 * layout.k.element_size() * layers
    return native, portable, native_int8, nbytes


def warmed_best_of(fns, repeats: int) -> list[float]:
    for fn in fns:
        fn()
    return best_of(fns, repeats)  # the calls alternate, so drift hits all alike


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--window", type=int, default=None, help="sliding window, tokens")
    parser.add_argument("--layers", type=int, default=1, help="decode over this many caches")
    args = parser.parse_args()
    print(
        f"threads {torch.get_num_threads()}, window {args.window or 'none'}, "
        f"decode over {args.layers} layer(s)"
    )
    for dtype in (torch.float32, torch.bfloat16):
        *fns, flops = prefill_case(dtype, args.window)
        times = warmed_best_of(fns, args.repeat)
        _report("prefill", dtype, *times, f"{flops / times[0] / 1e9:.0f} GFLOP/s")
        *fns, nbytes = decode_case(dtype, args.window, args.layers)
        times = warmed_best_of(fns, args.repeat)
        _report("decode", dtype, *times, f"{nbytes / times[0] / 1e9:.1f} GB/s of keys and values")


def _report(
    step: str, dtype: torch.dtype, native: float, portable: float, int8: float, rate: str
) -> None:
    print(
        f"{step:<7} {str(dtype)[6:]:>8}: native {native * 1e3:6.2f} ms ({rate}), "
        f"portable {portable * 1e3:6.2f} ms, {portable / native:.2f}x; "
        f"native over an int8 cache {int8 * 1e3:6.2f} ms, {native / int8:.2f}x"
    )


if __name__ == "__main__":
    main()
