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
  native    base + one native call for all runs (engine/kernels/lora.c, `LoRAStep.runs`),
            where the kernels are built

Where the native kernels are built the runner uses them; elsewhere it batches runs of at
most `lora.manager.BATCHED_ROWS` rows and gives longer ones matmuls of their own: this
script is the measurement behind both choices.

Run:  python benchmarks/lora_layer.py [--rounds 7] [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from torch import nn

from tokenmill.bench.timing import time_per_call

# Below the front door: a kernel micro-benchmark - it calls one LoRA layer, its kernel and
# its oneDNN base product directly, as a step does.
from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.lora.layers import LoRALinear, LoRAStep, SlotWeights
from tokenmill.engine.lora.manager import batched_rows
from tokenmill.engine.quant.packed_linear import PackedLinear, packs_dtype

# name -> (out, in, r_total) of SmolLM2-135M's fused projections, rank 16 per target.
LAYERS = {
    "qkv": (960, 576, 48),
    "o": (576, 576, 16),
    "gate_up": (3072, 576, 32),
    "down": (576, 1536, 16),
}
NUM_ADAPTERS = 8
STEPS = {"decode 64": 8, "prompt 512": 64}  # step shape -> rows per adapter


def load_adapters(
    wrapper: LoRALinear, shape: tuple[int, int, int], dtype: torch.dtype, generator
) -> None:
    """Fill every slot of `wrapper` (a layer of `shape`, a LAYERS value) with a random
    adapter of rank 16 per target, B zero outside each target's block as the runner
    prepares them."""
    out, inp, rank = shape
    targets = rank // 16
    blocks = tuple(
        (16 * t, 16 * (t + 1), out * t // targets, out * (t + 1) // targets) for t in range(targets)
    )
    for slot in range(wrapper.num_slots):
        a = torch.randn(inp, rank, generator=generator) * 0.02
        b = torch.zeros(rank, out)
        for lo, hi, out_lo, out_hi in blocks:
            b[lo:hi, out_lo:out_hi] = (
                torch.randn(hi - lo, out_hi - out_lo, generator=generator) * 0.02
            )
        wrapper.set_slot(slot, SlotWeights(a.to(dtype), b.to(dtype), blocks=blocks))


def build(
    dtype: torch.dtype, step: LoRAStep, native: bool
) -> dict[str, tuple[nn.Module, LoRALinear]]:
    """The four layers: base and wrapper, with NUM_ADAPTERS adapters loaded."""
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for name, shape in LAYERS.items():
        out, inp, _ = shape
        linear = nn.Linear(inp, out, bias=False).to(dtype)
        base = PackedLinear(linear) if packs_dtype(dtype) else linear
        wrapper = LoRALinear(base, step, NUM_ADAPTERS, native=native)
        load_adapters(wrapper, shape, dtype, generator)
        layers[name] = (base, wrapper)
    return layers


def forward(layers, native_layers, xs, step: LoRAStep, mode: str, runs, batched) -> None:
    """The four layers once: base alone, or wrapped with the step's rows per run, batched
    or in the native call."""
    step.clear()
    if mode == "per-run":
        step.segments, step.is_active = runs, True
    elif mode == "batched":
        step.batched, step.is_active = batched, True
    elif mode == "native":
        step.runs, step.is_active = torch.tensor(runs, dtype=torch.int64), True
        layers = native_layers
    with torch.inference_mode():
        for name, (base, wrapper) in layers.items():
            (base if mode == "base" else wrapper)(xs[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32,bfloat16")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, {NUM_ADAPTERS} adapters, rank 16 on every target")
    native = lora_kernel.available(torch.float32, torch.device("cpu"), 576)
    modes = ("base", "per-run", "batched", *(("native",) if native else ()))
    print("| dtype | step | base us | " + " | ".join(f"{m} us (+%)" for m in modes[1:]) + " |")
    print("|---|---|---:|" + "---:|" * (len(modes) - 1))
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        step = LoRAStep()
        layers = build(dtype, step, native=False)
        native_layers = build(dtype, step, native=True) if native else None
        for step_name, per_adapter in STEPS.items():
            num_rows = per_adapter * NUM_ADAPTERS
            runs = [(s, s * per_adapter, (s + 1) * per_adapter) for s in range(NUM_ADAPTERS)]
            xs = {n: torch.randn(num_rows, inp).to(dtype) for n, (_, inp, _) in LAYERS.items()}
            batched = batched_rows(runs, device=torch.device("cpu"), dtype=dtype)
            case = partial(forward, layers, native_layers, xs, step, runs=runs, batched=batched)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    times[mode].append(time_per_call(partial(case, mode=mode)) * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            extra = {k: (v / med["base"] - 1) * 100 for k, v in med.items()}
            cells = " | ".join(f"{med[m]:.0f} (+{extra[m]:.0f}%)" for m in modes[1:])
            print(f"| {dtype_name} | {step_name} | {med['base']:.0f} | {cells} |")


if __name__ == "__main__":
    main()
