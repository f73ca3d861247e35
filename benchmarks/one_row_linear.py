"""One-row bf16 linear layers: oneDNN's matmul against the native matvec, on the same
packed weights, and what it makes of a one-sequence decode step.

A one-sequence decode step sends one row through every linear layer of the model
(SmolLM2-135M: 121 calls, 269 MB of bf16 weights), so it runs at the speed the weights
stream from memory. Three measurements, alternated within each round (medians over
rounds):

  stream     torch's sum over a 1 GiB tensor: what the memory gives these threads (the
             roofline of a step's linear layers)
  layers     every PackedLinear of the model called with one row, through oneDNN
             (`torch.ops.mkldnn._linear_pointwise`) and through the native matvec
             (`PackedLinear.one_row`, engine/kernels/packed_matvec.c)
  step       one prompt of 200 tokens and 128 greedy tokens through `LLM.generate`, with
             the native matvec switched off and on: time per output token

Run:  python benchmarks/one_row_linear.py [--rounds 5] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.cpu import cpu_name
from tokenmill.bench.timing import time_per_call
from tokenmill.engine import resolve_model

# Below the front door: a kernel micro-benchmark - it finds the model's PackedLinear layers
# and calls their one-row matvec and oneDNN paths directly.
from tokenmill.engine.quant.packed_linear import PackedLinear

STREAM_BYTES = 1 << 30
PROMPT_TOKENS, OUTPUT_TOKENS = 200, 128
MIN_SECONDS = 0.3  # per timing of the stream and of the layers, in each round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()

    llm = LLM(str(resolve_model(args.model)), dtype="bfloat16")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    calls = [m.one_row for m in layers]
    if not all(calls):
        raise SystemExit(
            f"the native matvec serves {sum(map(bool, calls))} of {len(layers)} layers here "
            "(it needs AVX512-BF16 and oneDNN's pair layout)"
        )
    rows = [torch.randn(1, m.in_features).bfloat16() for m in layers]
    weight_bytes = sum(m.in_features * m.out_features * 2 for m in layers)
    stream = torch.ones(STREAM_BYTES // 4)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prompt = [list(range(100, 100 + PROMPT_TOKENS))]

    def onednn_layers() -> None:
        for m, x in zip(layers, rows):
            torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, m.bias, "none", [], "")

    def native_layers() -> None:
        for call, x in zip(calls, rows):
            call(x)

    def step(native: bool) -> float:
        for m, call in zip(layers, calls):
            m.one_row = call if native else None
        start = time.perf_counter()
        llm.generate(prompt, params)
        return (time.perf_counter() - start) / OUTPUT_TOKENS

    results: dict[str, list[float]] = {}
    with torch.inference_mode():
        step(True)  # warm-up
        for _ in range(args.rounds):
            for name, fn in (
                ("stream", stream.sum),
                ("layers oneDNN", onednn_layers),
                ("layers native", native_layers),
            ):
                results.setdefault(name, []).append(time_per_call(fn, MIN_SECONDS))
            for name, native in (("step oneDNN", False), ("step native", True)):
                results.setdefault(name, []).append(step(native))
    for m, call in zip(layers, calls):
        m.one_row = call
    med = {name: statistics.median(times) for name, times in results.items()}

    bandwidth = STREAM_BYTES / med["stream"] / 1e9
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; {args.rounds} rounds")
    print(f"model: {args.model}, {len(layers)} linear layers, {weight_bytes / 1e6:.0f} MB bf16")
    print(f"stream (1 GiB sum): {bandwidth:.1f} GB/s\n")
    print("| one row through every layer | ms | GB/s | share of stream |")
    print("|---|---:|---:|---:|")
    for name in ("layers oneDNN", "layers native"):
        rate = weight_bytes / med[name] / 1e9
        print(f"| {name[7:]} | {med[name] * 1e3:.2f} | {rate:.1f} | {rate / bandwidth:.0%} |")
    print(f"\nnative / oneDNN speed: {med['layers oneDNN'] / med['layers native']:.2f}x")
    print(
        f"decode step, one sequence ({PROMPT_TOKENS}-token prompt, {OUTPUT_TOKENS} tokens): "
        f"oneDNN {med['step oneDNN'] * 1e3:.2f} ms/token, native "
        f"{med['step native'] * 1e3:.2f} ms/token "
        f"({med['step oneDNN'] / med['step native']:.2f}x)"
    )


if __name__ == "__main__":
    main()
