"""Where a LoRA job's time goes beyond the base model's, on `lora8`'s rows.

Four configurations, each on a fresh engine warmed up as `tokenmill bench` does (its
adapters read and in their slots, the prefix cache then emptied) and timed as one
`llm.generate` call, alternating for `--rounds` rounds (best of each reported):

  base                     the base model on every row
  8 adapters               row i on adapter i mod 8 (the bench's `lora8`)
  8 adapters, no terms     the same, the native call skipped: the terms left out, every
                           other cost of serving adapters kept (the prefix cache's keys
                           and values per adapter, the wrappers, the run tables)
  1 adapter, no terms      every row on one adapter, the call skipped: the prefix cache
                           shares as for the base, so what is left is the wrappers

The differences split the 8-adapter run's extra time into the terms themselves, the
prefix cache that cannot be shared across adapters, and the rest. Outputs of the
no-terms runs are wrong by construction; only their time is read.

Run:  python benchmarks/lora_breakdown.py [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.lora import load_adapters_before_the_clock, make_adapters
from tokenmill.bench.timing import fixed_length_params
from tokenmill.bench.workload import load_preset, warmup_prompts
from tokenmill.engine import resolve_model

# Below the front door: it times the LoRA kernel's calls inside a real run by wrapping
# LoRATables.add, the one place those calls pass.
from tokenmill.engine.kernels import lora as lora_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    workload = load_preset("lora8", model)
    params = fixed_length_params(workload)
    warmup = SamplingParams(temperature=0.0, max_tokens=4)
    rows = len(workload.prompt_ids)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, tmp, num_adapters=8, rank=16)
        eight = [LoRARequest(f"adapter-{i % 8}", str(paths[i % 8])) for i in range(rows)]
        one = [LoRARequest("adapter-0", str(paths[0]))] * rows
        real_call = lora_kernel.LoRATables.add

        def skipped(*_args, **_kwargs) -> None:
            return None

        configurations = {
            "base": (None, real_call),
            "8 adapters": (eight, real_call),
            "8 adapters, no terms": (eight, skipped),
            "1 adapter, no terms": (one, skipped),
        }
        best: dict[str, float] = {}
        try:
            for _ in range(args.rounds):
                for name, (requests, call) in configurations.items():
                    llm = LLM(model, dtype=args.dtype)
                    load_adapters_before_the_clock(
                        llm, requests or [None], warmup_prompts(workload)[0], warmup
                    )
                    lora_kernel.LoRATables.add = call
                    start = time.perf_counter()
                    llm.generate(workload.prompt_ids, params, lora_request=requests)
                    elapsed = time.perf_counter() - start
                    best[name] = min(best.get(name, elapsed), elapsed)
                    del llm
        finally:
            lora_kernel.LoRATables.add = real_call
    base = best["base"]
    print(f"{args.dtype}, lora8's {rows} rows, best of {args.rounds}")
    print("| configuration | wall s | x base |")
    print("|---|---:|---:|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {base / seconds:.3f} |")
    terms = best["8 adapters"] - best["8 adapters, no terms"]
    prefix = best["8 adapters, no terms"] - best["1 adapter, no terms"]
    rest = best["1 adapter, no terms"] - base
    print(f"terms {terms:.2f} s, unshared prefix cache {prefix:.2f} s, the rest {rest:.2f} s")


if __name__ == "__main__":
    main()
