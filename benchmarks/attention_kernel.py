"""The native attention kernel against the portable PyTorch path, side by side.

    python benchmarks/attention_kernel.py

One layer of SmolLM2's attention shape (9 query heads, 3 kv heads, head_dim 64, 16-token
blocks scattered over the cache) on two step shapes, fp32 and bf16:
- prefill: six prompt chunks of 5-948 tokens, some continuing cached context (1,100
  positions at most) - the portable path gathers each chunk's context and calls SDPA
  (fp32) or its batched-matmul attention (bf16) once per chunk;
- decode: 64 sequences, half sharing a 256-token prefix (mixed64's layout) - the
  portable path gathers every context and runs one padded SDPA.
Best of 7 calls after a warm-up, alternating the two paths; the ratio is what to read.
--window N attends within a sliding window of N positions (Mistral's and Gemma 3's local
layers) on both paths.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from tokenmill.engine.attention import (
    AttentionMetadata,
    PrefillSpan,
    _decode_attention,
    _prefill_span_attention,
)
from tokenmill.engine.kernels.paged_attention import AttentionEntries, native_paged_attention
from tokenmill.engine.shared_prefix import group_shared_prefixes

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

    def native():
        native_paged_attention(q, layout.k, layout.v, entries, HEAD_DIM**-0.5, window)

    def portable():
        for span in spans:
            _prefill_span_attention(q, k, v, layout.k, layout.v, span, HEAD_DIM**-0.5, window)

    seen = sum(min(p + 1, window or p + 1) for n, c in PREFILL for p in range(c - n, c))
    flops = seen * 4 * HEAD_DIM * HEADS
    return native, portable, flops


def decode_case(dtype, window=None):
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
    meta = AttentionMetadata(
        slot_blocks=_int64([]),
        slot_offsets=_int64([]),
        num_decode_tokens=len(lengths),
        block_size=BLOCK,
        native=None,
        decode_block_tables=_padded(tables),
        decode_context_lens=_int64(lengths),
        prefills=[],
    )

    def native():
        native_paged_attention(q, layout.k, layout.v, entries, HEAD_DIM**-0.5, window)

    def portable():
        _decode_attention(q, layout.k, layout.v, meta, HEAD_DIM**-0.5, window)

    # Positions read once a shared prefix is read once (or only each window's).
    read = sum(min(n, window) for n in lengths) if window else sum(lengths) - 31 * 256
    return native, portable, read * KV_HEADS * HEAD_DIM * 2 * layout.k.element_size()


def best_of(fns, repeats: int) -> list[float]:
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):  # alternate, so drift hits both alike
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--window", type=int, default=None, help="sliding window, tokens")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, window {args.window or 'none'}")
    for dtype in (torch.float32, torch.bfloat16):
        native, portable, flops = prefill_case(dtype, args.window)
        times = best_of([native, portable], args.repeat)
        _report("prefill", dtype, *times, f"{flops / times[0] / 1e9:.0f} GFLOP/s")
        native, portable, nbytes = decode_case(dtype, args.window)
        times = best_of([native, portable], args.repeat)
        _report("decode", dtype, *times, f"{nbytes / times[0] / 1e9:.1f} GB/s of keys and values")


def _report(step: str, dtype: torch.dtype, native: float, portable: float, rate: str) -> None:
    print(
        f"{step:<7} {str(dtype)[6:]:>8}: native {native * 1e3:6.2f} ms ({rate}), "
        f"portable {portable * 1e3:6.2f} ms, {portable / native:.2f}x"
    )


if __name__ == "__main__":
    main()
