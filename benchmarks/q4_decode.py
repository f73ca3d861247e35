"""The GGUF Q4_0 layer at decode batch sizes against the machine's read bandwidth and
against its own arithmetic, at Llama-3.1-8B's projection shapes.

A decode step of 1-16 rows reads every weight once and does little arithmetic per byte,
so its bound is the read bandwidth - unless the integer dot products take longer than
reading the blocks. This prints, per shape and row count, three times for the weight's
bytes, measured in one process and alternating within every round (medians over rounds,
so a busy machine slows all of them alike):

  read      the Q4_0 weight's bytes (18 per 32 weights) at a read-only probe's rate (a sum
            over a buffer larger than the last-level cache)
  compute   the kernel on a weight that stays in L2 (no memory traffic): the slope of its
            time between two L2-resident weights of the shape's k (so the per-call cost
            drops out), scaled to the shape's bytes - its compute-only time
  streamed  the kernel on the shape's weight read from memory: several random copies
            whose bytes together pass --footprint-mb, used in turn

The streamed time cannot beat max(read, compute): where compute > read the bandwidth
target is bounded by the arithmetic on this CPU, and the table says so. Each of
q4_linear.c as --against has it and as this tree has it is built here the same way and
called directly (tm_q4_linear on preallocated buffers), so the two builds' GB/s compare
in one run. Timing is CPU time by default (process time over the threads: spin-waits
count, so it errs slow), or wall time with --clock wall.

Run:  python benchmarks/q4_decode.py [--against main] [--rows 1,2,4,8,16] [--threads 1]
          [--rounds 5] [--shapes o,kv,gate_up,down] [--footprint-mb 512]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Below the front door: a kernel micro-benchmark - it builds two revisions' q4_linear.c
# with the engine's compiler and flags and calls tm_q4_linear on the packed layout.
from tokenmill.engine.kernels import q4_linear as native_q4
from tokenmill.engine.kernels.interface import Q4LinearArgs

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import TREE_KERNELS, build_library, revision_kernels  # noqa: E402

SHAPES = {  # name -> (N, K) of Llama-3.1-8B's projections
    "o": (4096, 4096),
    "kv": (1024, 4096),
    "gate_up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
Q4_0_BYTES_PER_WEIGHT = 18 / 32
L2_WEIGHT_BYTES = 1 << 20  # the larger cache-resident weight; the smaller is a quarter


def build(kernels: Path, out: Path) -> ctypes.CDLL:
    """q4_linear.c (and amx.c, for the tile permission) from `kernels` into one library at
    `out`, as the engine builds them."""
    lib = build_library(kernels, ("q4_linear.c", "amx.c"), out)
    lib.tm_q4_linear.argtypes = [ctypes.POINTER(Q4LinearArgs)]
    lib.tm_q4_linear.restype = ctypes.c_int
    return lib


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


def random_q4_0(n: int, k: int, generator: torch.Generator) -> native_q4.PackedQ4Weight:
    """A packed Q4_0 weight of random nibbles and fp16-exact scales."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // 32, generator=generator) * 0.01 + 1e-3).half().float()
    return native_q4.pack_q4_weight(q, scale, None)


def caller(lib: ctypes.CDLL, x: torch.Tensor, weights: list, threads: int) -> Callable[[], int]:
    """A call of tm_q4_linear on x and the next of `weights` in turn, its buffers made once."""
    rows, k = x.shape
    n = weights[0].out_features
    qx = torch.empty(rows * k, dtype=torch.int8)
    scales = torch.empty(rows * k // 32)
    sums = torch.empty(rows * k // 32, dtype=torch.int32)
    out = torch.empty(rows, n, dtype=x.dtype)
    args = [
        Q4LinearArgs(
            x=x.data_ptr(),
            qx=qx.data_ptr(),
            x_scales=scales.data_ptr(),
            x_sums=sums.data_ptr(),
            w=w.blocks.data_ptr(),
            bias=None,
            out=out.data_ptr(),
            rows=rows,
            n=n,
            k=k,
            is_bf16=int(x.dtype == torch.bfloat16),
            num_threads=threads,
            affine=0,
        )
        for w in weights
    ]
    refs = [ctypes.byref(a) for a in args]
    turn = [0]

    def call() -> int:
        turn[0] = (turn[0] + 1) % len(refs)
        return lib.tm_q4_linear(refs[turn[0]])

    call.keep = (qx, scales, sums, out, weights)  # type: ignore[attr-defined]
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="main", help="the git revision to compare with")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--shapes", default="o,kv,gate_up,down")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--footprint-mb", type=int, default=512)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="q4-decode-"))
    builds = {
        args.against: build(revision_kernels(args.against, tmp), tmp / "against.so"),
        "tree": build(TREE_KERNELS, tmp / "tree.so"),
    }
    probe = torch.ones(args.footprint_mb * (1 << 20) // 4)
    generator = torch.Generator().manual_seed(0)
    print(
        f"# {args.threads} threads, {args.clock} time, native {native_q4.native_q4_isa()}; "
        "bf16 rows; microseconds per call for the shape's Q4_0 bytes: read (at the probe's "
        "rate), compute (cache-resident), streamed; GB/s of Q4_0 bytes and their share of "
        "the read probe"
    )
    print(
        f"| shape | rows | probe GB/s | read us | {args.against} compute us | "
        f"{args.against} streamed | tree compute us | tree streamed us | tree streamed | "
        "bound |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight_bytes = n * k * Q4_0_BYTES_PER_WEIGHT
        copies = max(2, -(-args.footprint_mb * (1 << 20) // int(weight_bytes)))
        weights = [random_q4_0(n, k, generator) for _ in range(copies)]
        # Two cache-resident weights of this k (n a multiple of the 32-channel tile).
        n_big = max(64, int(L2_WEIGHT_BYTES / (k * Q4_0_BYTES_PER_WEIGHT)) // 32 * 32)
        resident = {m: [random_q4_0(m, k, generator)] for m in (n_big, n_big // 4)}
        resident_bytes = {m: m * k * Q4_0_BYTES_PER_WEIGHT for m in resident}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=generator).bfloat16()
            calls: dict[str, Callable[[], object]] = {}
            for build_name, lib in builds.items():
                calls[f"{build_name} streamed"] = caller(lib, x, weights, args.threads)
                for m, w in resident.items():
                    calls[f"{build_name} {m}"] = caller(lib, x, w, args.threads)
            times: dict[str, list[float]] = {c: [] for c in ("probe", *calls)}
            for _ in range(args.rounds):
                times["probe"].append(seconds_per_call(probe.sum, args.clock, args.threads))
                for key, call in calls.items():
                    times[key].append(seconds_per_call(call, args.clock, args.threads))
            median = {key: statistics.median(t) for key, t in times.items()}
            read_gbs = probe.numel() * 4 / median["probe"] / 1e9
            read_us = weight_bytes / read_gbs / 1e3
            cells = []
            for build_name in builds:
                slope = (median[f"{build_name} {n_big}"] - median[f"{build_name} {n_big // 4}"]) / (
                    resident_bytes[n_big] - resident_bytes[n_big // 4]
                )
                compute_us = slope * weight_bytes * 1e6
                streamed_us = median[f"{build_name} streamed"] * 1e6
                gbs = weight_bytes / streamed_us / 1e3
                # A slope at or below zero: the machine's noise outweighed the difference.
                compute = f"{compute_us:.0f}" if compute_us > 0 else "-"
                if build_name == "tree":
                    cells += [compute, f"{streamed_us:.0f}"]
                else:
                    cells.append(compute)
                cells.append(f"{gbs:.1f} ({gbs / read_gbs:.0%})")
            bound = "-" if compute_us <= 0 else "compute" if compute_us > read_us else "read"
            print(
                f"| {name} {n}x{k} | {rows} | {read_gbs:.1f} | {read_us:.0f} | "
                + " | ".join(cells)
                + f" | {bound} |"
            )
        del weights, resident


if __name__ == "__main__":
    main()
