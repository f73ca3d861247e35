"""Greedy outputs of tokenmill on CUDA against its CPU fp32 path, on the same prompts.

    python benchmarks/gpu_correctness.py [--model M] [--max-tokens 32] [--json OUT]

Runs a handful of prompts (chat-templated text, some sharing a long prefix so the
prefix cache is exercised, plus random-id prompts from the mixed64 generator) through
CPU fp32 (the reference), CUDA fp32 and CUDA bf16, and reports per configuration how
many completions are token-identical to the reference and the mean length of the
agreeing prefix. CUDA fp32 should agree almost everywhere (kernel order differences
can flip a near-tie); bf16 agrees on most prompts and diverges late on the rest.
Exits non-zero only if a configuration fails to run or CUDA fp32 agrees on fewer than
half the prompts (which would mean a bug, not rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import load_preset
from tokenmill.engine import Tokenizer, resolve_model

_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do?",
]
_SHARED_SYSTEM = (
    "You are a meticulous assistant for a data team. Answer in plain English, keep every "
    "answer short, never invent facts, and say so when you do not know. " * 4
)


def build_prompts(model_dir) -> list[list[int]]:
    """Token ids: plain chat questions, the same questions behind a long shared system
    prompt, and a few random-id prompts from the benchmark generator."""
    conversations = [[{"role": "user", "content": q}] for q in _QUESTIONS]
    conversations += [
        [{"role": "system", "content": _SHARED_SYSTEM}, {"role": "user", "content": q}]
        for q in _QUESTIONS[:4]
    ]
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    prompts += load_preset("mixed64", model_dir).prompt_ids[:6]
    return prompts


def greedy(model: str | None, dtype: str, device: str, prompts, max_tokens: int):
    llm = LLM(model, dtype=dtype, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    del llm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return [o.token_ids for o in outputs], elapsed


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    prefixes = []
    for out, ref in zip(outputs, reference):
        n = 0
        for a, b in zip(out, ref):
            if a != b:
                break
            n += 1
        prefixes.append(n)
    return {
        "identical": sum(o == r for o, r in zip(outputs, reference)),
        "num_prompts": len(reference),
        "mean_agreeing_prefix": sum(prefixes) / len(prefixes),
        "agreeing_prefix": prefixes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    # --device cpu dry-runs the script where there is no GPU (bf16 vs fp32 on the CPU).
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1

    prompts = build_prompts(resolve_model(args.model))
    reference, cpu_s = greedy(args.model, "float32", "cpu", prompts, args.max_tokens)
    print(f"reference: CPU fp32, {len(prompts)} prompts x {args.max_tokens} tokens, {cpu_s:.1f} s")

    report: dict = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "configs": {}}
    failed = False
    for dtype in ("float32", "bfloat16"):
        name = f"{args.device}-{dtype}"
        try:
            outputs, seconds = greedy(args.model, dtype, args.device, prompts, args.max_tokens)
        except Exception as error:  # report and go on: the other dtype may still work
            print(f"{name}: FAILED - {type(error).__name__}: {error}")
            report["configs"][name] = {"error": f"{type(error).__name__}: {error}"}
            failed = True
            continue
        result = agreement(outputs, reference) | {"seconds": seconds}
        report["configs"][name] = result
        print(
            f"{name}: {result['identical']}/{result['num_prompts']} identical to cpu-float32, "
            f"mean agreeing prefix {result['mean_agreeing_prefix']:.1f}/{args.max_tokens} tokens "
            f"({seconds:.2f} s)"
        )
        if dtype == "float32" and result["identical"] < len(prompts) / 2:
            failed = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
