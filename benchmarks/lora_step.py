"""The native LoRA call's cost per engine step at SmolLM2-135M's shapes, weights cold.

`lora_layer.py` times four wrapped layers with their weights hot in cache; a real step
walks 30 layers x 4 projections, each with its own 8 adapters' weights, so every call
reads them from L3 or memory. This script builds those 120 layers' slots (8 adapters of
rank 16 on every target, bf16 or fp32), cycles through them as a step does, and times the
native call alone: the whole term, and the shrink alone (the expand is the difference).

Run:  python benchmarks/lora_step.py [--rows 64,1872] [--dtype bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from lora_layer import LAYERS, NUM_ADAPTERS, load_adapters

# Below the front door: a kernel micro-benchmark - a step's LoRA layers called directly.
from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.lora.layers import LoRALinear, LoRAStep

NUM_LAYERS = 30


def build(dtype: torch.dtype, rows: int) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """Each layer's call tables, as a wrapper keeps them (whole terms, and the shrink alone:
    no block to expand), with its own x and y."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(NUM_LAYERS):
        for shape in LAYERS.values():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,1872", help="rows per step, split over 8 adapters")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not lora_kernel.available(dtype, torch.device("cpu"), 576):
        raise SystemExit("the native kernels are not built here")
    print(
        f"threads {torch.get_num_threads()}, {args.dtype}, {NUM_LAYERS * len(LAYERS)} layers cycled"
    )
    print("| rows | term ms/step | shrink ms/step | expand ms/step | us per call |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        per = rows // NUM_ADAPTERS
        runs = torch.tensor([(s, s * per, (s + 1) * per) for s in range(NUM_ADAPTERS)])
        layers = build(dtype, rows)
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
