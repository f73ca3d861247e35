"""The native LoRA call's cost per engine step at SmolLM2-135M's shapes, weights cold.

`lora_layer.py` times four wrapped layers with their weights hot in cache; a real step
walks 30 layers x 4 projections, each with its own 8 adapters' weights, so every call
reads them from L3 or memory. This script builds those 120 layers' slots (8 adapters of
rank 16 on every target, bf16 or fp32), cycles through them as a step does, and times the
native call alone: the whole term, and the shrink alone (the expand is the difference).

With --against REV it times lora.c as REV has it and as this tree has it instead, each
built here the same way (benchmarks/kernel_builds.py) and the two alternating within every
round: the whole term's CPU time per step (process time over the threads, so spin-waits
count) for each, medians over rounds, and their ratio - a busy machine slows both alike.
--layers cycles fewer layers' weights (hotter in cache); --model llama-3.2-1b takes that
model's shapes (hidden 2048) instead of SmolLM2-135M's.

Run:  python benchmarks/lora_step.py [--rows 64,1872] [--dtype bfloat16] [--rounds 5]
          [--against REV] [--layers 30] [--threads N] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_builds import TREE_KERNELS, build_library, revision_kernels
from lora_layer import LAYERS, NUM_ADAPTERS, load_adapters

# Below the front door: a kernel micro-benchmark - a step's LoRA layers called directly.
from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.lora.layers import LoRALinear, LoRAStep

NUM_LAYERS = 30
# --model -> (out, in, r_total) per fused projection, rank 16 per target (LAYERS' form).
MODELS = {
    "smollm2-135m": LAYERS,
    "llama-3.2-1b": {
        "qkv": (3072, 2048, 48),
        "o": (2048, 2048, 16),
        "gate_up": (16384, 2048, 32),
        "down": (2048, 8192, 16),
    },
}


def build(
    dtype: torch.dtype, rows: int, num_layers: int = NUM_LAYERS, shapes: dict = LAYERS
) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """Each layer's call tables, as a wrapper keeps them (whole terms, and the shrink alone:
    no block to expand), with its own x and y."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(num_layers):
        for shape in shapes.values():
            out, inp, _ = shape
            w = LoRALinear(torch.nn.Identity(), LoRAStep(), NUM_ADAPTERS, native=True)
            load_adapters(w, shape, dtype, generator)
            tables = {
                shrink_only: lora_kernel.LoRATables(
                    w.a,
                    w.b,
                    w.slot_ranks,
                    w.slot_blocks,
                    torch.zeros_like(w.slot_num_blocks) if shrink_only else w.slot_num_blocks,
                )
                for shrink_only in (False, True)
            }
            x = torch.randn(rows, inp, generator=generator).to(dtype)
            layers.append((tables, x, torch.zeros(rows, out, dtype=dtype)))
    return layers


def step(layers, runs: torch.Tensor, shrink_only: bool) -> None:
    for tables, x, y in layers:
        tables[shrink_only].add(x, y, runs)


def build_lora(kernels: Path, out: Path) -> ctypes.CDLL:
    """lora.c (and amx.c, for the tile permission) from `kernels` into one library at `out`,
    as the engine builds them."""
    lib = build_library(kernels, ("lora.c", "amx.c"), out)
    lib.tm_lora.restype = ctypes.c_int
    return lib


def against(args, dtype: torch.dtype) -> None:
    """The whole term per step with `args.against`'s lora.c and with this tree's, alternating."""
    tmp = Path(tempfile.mkdtemp(prefix="lora-step-"))
    builds = {
        args.against: build_lora(revision_kernels(args.against, tmp), tmp / "against.so"),
        "tree": build_lora(TREE_KERNELS, tmp / "tree.so"),
    }
    threads = torch.get_num_threads()
    print(f"| rows | {args.against} CPU ms/step | tree CPU ms/step | {args.against} / tree |")
    print("|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        per = rows // NUM_ADAPTERS
        runs = torch.tensor([(s, s * per, (s + 1) * per) for s in range(NUM_ADAPTERS)])
        layers = build(dtype, rows, args.layers, MODELS[args.model])
        times = {name: [] for name in builds}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name, lib in builds.items():
                # LoRATables calls whatever library the module's _library() gives.
                lora_kernel._library = lambda lib=lib: lib
                steps, start = 0, time.process_time()
                while (elapsed := time.process_time() - start) < 0.05 or not steps:
                    step(layers, runs, False)
                    steps += 1
                if round_:
                    times[name].append(elapsed / steps / threads * 1e3)
        old, new = (statistics.median(t) for t in times.values())
        print(f"| {rows} | {old:.3f} | {new:.3f} | {old / new:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,1872", help="rows per step, split over 8 adapters")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", help="a git revision whose lora.c to time beside this tree's")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help="decoder layers cycled")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2-135m")
    parser.add_argument("--threads", type=int, help="default: torch's")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not lora_kernel.available(dtype, torch.device("cpu"), 576):
        raise SystemExit("the native kernels are not built here")
    if args.against:
        print(
            f"threads {torch.get_num_threads()}, {args.dtype}, "
            f"{args.layers * len(LAYERS)} layers of {args.model} cycled"
        )
        against(args, dtype)
        return
    print(
        f"threads {torch.get_num_threads()}, {args.dtype}, {args.layers * len(LAYERS)} layers cycled"
    )
    print("| rows | term ms/step | shrink ms/step | expand ms/step | us per call |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        per = rows // NUM_ADAPTERS
        runs = torch.tensor([(s, s * per, (s + 1) * per) for s in range(NUM_ADAPTERS)])
        layers = build(dtype, rows, args.layers, MODELS[args.model])
        times = {}
        for shrink_only in (False, True, False, True):  # the first of each warms up
            step(layers, runs, shrink_only)
            start = time.perf_counter()
            for _ in range(args.rounds):
                step(layers, runs, shrink_only)
            times[shrink_only] = (time.perf_counter() - start) / args.rounds * 1e3
        whole, shrink = times[False], times[True]
        calls = len(layers)
        print(
            f"| {rows} | {whole:.2f} | {shrink:.2f} | {whole - shrink:.2f} | {whole / calls * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
