"""What a LoRA wrapper adds to its base layer, at SmolLM2-135M's shapes, per step shape.

A decoder layer's four engine projections (qkv, o, gate_up, down) are wrapped in
`LoRALinear` with 8 adapters loaded, each of rank 16 on every target (r_total 48 on qkv,
32 on gate_up, 16 on o and down). For each step shape - a decode step (64 rows, 8 per
adapter) and a prompt chunk (512 rows, 64 per adapter) - three ways alternate within each
round, and the table gives medians over rounds, in microseconds for the four layers
together and as a share of the base layers' time:

  base      the base layers alone (the engine's PackedLinear where oneDNN has the dtype)
  per-run   base + two matmuls per adapter's run of rows (`LoRAStep.segments`)
  batched   base + one padded batched matmul pair over all runs (`LoRAStep.batched`)

The runner batches runs of at most `worker.lora.BATCHED_ROWS` rows and gives longer ones
matmuls of their own: this script is the measurement behind that threshold.

Run:  python benchmarks/lora_layer.py [--rounds 7] [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from torch import nn

from tokenmill.bench.timing import time_per_call
from tokenmill.engine.models.lora_layers import LoRALinear, LoRAStep, SlotWeights
from tokenmill.engine.quant.packed_linear import PackedLinear, packs_dtype
from tokenmill.engine.worker.lora import batched_rows

# name -> (out, in, r_total) of SmolLM2-135M's fused projections, rank 16 per target.
LAYERS = {
    "qkv": (960, 576, 48),
    "o": (576, 576, 16),
    "gate_up": (3072, 576, 32),
    "down": (576, 1536, 16),
}
NUM_ADAPTERS = 8
STEPS = {"decode 64": 8, "prompt 512": 64}  # step shape -> rows per adapter


def build(dtype: torch.dtype, step: LoRAStep) -> dict[str, tuple[nn.Module, LoRALinear]]:
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for name, (out, inp, rank) in LAYERS.items():
        linear = nn.Linear(inp, out, bias=False).to(dtype)
        base = PackedLinear(linear) if packs_dtype(dtype) else linear
        wrapper = LoRALinear(base, step, NUM_ADAPTERS)
        for slot in range(NUM_ADAPTERS):
            a = torch.randn(inp, rank, generator=generator) * 0.02
            b = torch.randn(rank, out, generator=generator) * 0.02
            wrapper.set_slot(slot, SlotWeights(a.to(dtype), b.to(dtype)))
        layers[name] = (base, wrapper)
    return layers


def forward(layers, xs, step: LoRAStep, mode: str, runs, batched) -> None:
    """The four layers once: base alone, or wrapped with the step's rows per run or batched."""
    step.clear()
    if mode == "per-run":
        step.segments, step.is_active = runs, True
    elif mode == "batched":
        step.batched, step.is_active = batched, True
    with torch.inference_mode():
        for name, (base, wrapper) in layers.items():
            (base if mode == "base" else wrapper)(xs[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32,bfloat16")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, {NUM_ADAPTERS} adapters, rank 16 on every target")
    print("| dtype | step | base us | per-run us (+%) | batched us (+%) |")
    print("|---|---|---:|---:|---:|")
    modes = ("base", "per-run", "batched")
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        step = LoRAStep()
        layers = build(dtype, step)
        for step_name, per_adapter in STEPS.items():
            num_rows = per_adapter * NUM_ADAPTERS
            runs = [(s, s * per_adapter, (s + 1) * per_adapter) for s in range(NUM_ADAPTERS)]
            xs = {n: torch.randn(num_rows, inp).to(dtype) for n, (_, inp, _) in LAYERS.items()}
            batched = batched_rows(runs, device=torch.device("cpu"), dtype=dtype)
            case = partial(forward, layers, xs, step, runs=runs, batched=batched)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    times[mode].append(time_per_call(partial(case, mode=mode)) * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            extra = {k: (v / med["base"] - 1) * 100 for k, v in med.items()}
            print(
                f"| {dtype_name} | {step_name} | {med['base']:.0f} | "
                f"{med['per-run']:.0f} (+{extra['per-run']:.0f}%) | "
                f"{med['batched']:.0f} (+{extra['batched']:.0f}%) |"
            )


if __name__ == "__main__":
    main()
