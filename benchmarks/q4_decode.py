"""The GGUF Q4_0 layer at decode batch sizes against the machine's read bandwidth, at
Llama-3.1-8B's projection shapes.

A decode step of 1-16 rows reads every weight once and does little arithmetic per byte,
so its bound is the read bandwidth: this prints, per shape and row count, the Q4_0
weight bytes (18 per 32 weights) read per second by each path of the layer and their
share of a read-only probe (a sum over a buffer larger than the last-level cache)
measured in the same process, alternating with the kernels within every round (the
table shows medians over rounds, so a busy machine slows probe and kernels alike).

Paths (engine/quant/gguf_linear.Q4Linear chooses between them by row count):
  native  q4_linear.c: the rows quantized in blocks of 32, integer dot products
  tiles   q4_tiles.c: the blocks expanded per call into AMX bf16 tiles (AMX CPUs only)
  layer   Q4Linear as it runs: native, or tiles from TILES_MIN_ROWS rows

The weights are several random copies whose bytes together pass --footprint-mb, used in
turn, so that each call reads its weight from memory, not from a large last-level cache
that one copy would fit in. Timing is CPU time by default (process time over the torch
threads: spin-waits count, so it errs slow), or wall time with --clock wall.

Run:  python benchmarks/q4_decode.py [--rows 1,2,4,8,16] [--threads 1] [--rounds 5]
          [--shapes o,kv,gate_up,down] [--footprint-mb 512]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = {  # name -> (N, K) of Llama-3.1-8B's projections
    "o": (4096, 4096),
    "kv": (1024, 4096),
    "gate_up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
Q4_0_BYTES_PER_WEIGHT = 18 / 32


def seconds_per_call(call: Callable[[], object], clock: str, threads: int) -> float:
    """Seconds per call over at least 0.1 s of the chosen clock (once to warm up)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    scale = 1 / threads if clock == "cpu" else 1.0
    call()
    calls, start = 0, now()
    while True:
        call()
        calls += 1
        elapsed = now() - start
        if elapsed >= 0.1:
            return elapsed * scale / calls


# Below the front door: a kernel micro-benchmark - the Q4_0 kernels and the layer class
# are built and called directly on packed weights.
def random_q4_0(n: int, k: int, generator: torch.Generator):
    """A packed Q4_0 weight of random nibbles and fp16-exact scales."""
    from tokenmill.engine.kernels import q4_linear as native_q4

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // 32, generator=generator) * 0.01 + 1e-3).half().float()
    return native_q4.pack_q4_weight(q, scale, None)


def main() -> None:
    from tokenmill.engine.kernels import q4_linear as native_q4
    from tokenmill.engine.quant.gguf_linear import Q4Linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--shapes", default="o,kv,gate_up,down")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--footprint-mb", type=int, default=512)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    probe = torch.ones(args.footprint_mb * (1 << 20) // 4)
    generator = torch.Generator().manual_seed(0)
    print(
        f"# {args.threads} threads, {args.clock} time, native {native_q4.native_q4_isa()}, "
        f"tiles {native_q4.tiles_available()}; GB/s of Q4_0 weight bytes, and their share "
        "of the read probe"
    )
    print("| shape | rows | read probe GB/s | native | tiles | layer |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight_bytes = n * k * Q4_0_BYTES_PER_WEIGHT
        copies = max(2, -(-args.footprint_mb * (1 << 20) // int(weight_bytes)))
        weights = [random_q4_0(n, k, generator) for _ in range(copies)]
        layers = [Q4Linear(w) for w in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=generator).bfloat16()
            turn = {"w": itertools.cycle(weights), "l": itertools.cycle(layers)}
            paths: dict[str, Callable[[], object]] = {
                "native": lambda x=x, turn=turn: native_q4.q4_linear(x, next(turn["w"])),
                "layer": lambda x=x, turn=turn: next(turn["l"])(x),
            }
            if native_q4.tiles_available():
                paths["tiles"] = lambda x=x, turn=turn: native_q4.q4_linear_tiles(
                    x, next(turn["w"])
                )
            times: dict[str, list[float]] = {p: [] for p in ("probe", *paths)}
            for _ in range(args.rounds):
                times["probe"].append(seconds_per_call(probe.sum, args.clock, args.threads))
                for path, call in paths.items():
                    times[path].append(seconds_per_call(call, args.clock, args.threads))
            read_gbs = probe.numel() * 4 / statistics.median(times["probe"]) / 1e9
            cells = []
            for path in ("native", "tiles", "layer"):
                if path not in paths:
                    cells.append("-")
                    continue
                gbs = weight_bytes / statistics.median(times[path]) / 1e9
                cells.append(f"{gbs:.1f} ({gbs / read_gbs:.0%})")
            print(f"| {name} {n}x{k} | {rows} | {read_gbs:.1f} | " + " | ".join(cells) + " |")
        del weights, layers


if __name__ == "__main__":
    main()
