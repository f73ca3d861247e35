"""Where a GPU generate's time goes: busy vs idle device time, and kernel time by kind.

    python benchmarks/gpu_profile.py [--model M] [--preset mixed1k] [--json OUT]

Runs the preset's shape once to warm up, once timed, then under torch.profiler, and
reports the wall time, the union of the intervals in which any kernel ran (busy time:
the rest is the device waiting for the host), and kernel time grouped by kind
(attention, cache store, GEMM, elementwise, sampling, copies). Engine options can be switched off to show what each
step-level feature buys: --no-graphs, --no-overlap.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import load_preset
from tokenmill.engine import resolve_model

_KINDS = (
    ("attention", ("paged_attention_kernel",)),
    ("kv store", ("store_kv_kernel",)),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("sampling", ("argmax", "argmin", "topk", "sort", "softmax", "exponential", "scatter")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in _KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "elementwise/other"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, current_end = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if start > current_end:
            total += end - start
            current_end = end
        elif end > current_end:
            total += end - current_end
            current_end = end
    return total / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="mixed1k")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    workload = load_preset(args.preset, model_dir)
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device="cuda",
        cuda_graphs=not args.no_graphs,
        overlap_steps=not args.no_overlap,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    # Warm-up on other prompts of the same shape: kernels compiled, allocator settled, and
    # nothing of the profiled prompts in the prefix cache.
    llm.generate(load_preset(args.preset, model_dir, seed=12345).prompt_ids, params)
    # Timed without the profiler (which slows the host), on prompts of their own.
    timed = load_preset(args.preset, model_dir, seed=54321)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(timed.prompt_ids, params)
    plain_wall = time.perf_counter() - start
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        outputs = llm.generate(workload.prompt_ids, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    by_kind: dict[str, float] = defaultdict(float)
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start_us = event.time_range.start
            end_us = event.time_range.end
            intervals.append((start_us, end_us))
            by_kind[kind_of(event.name)] += (end_us - start_us) / 1e6
    busy = busy_seconds(intervals)
    tokens = sum(o.prompt_tokens + o.completion_tokens for o in outputs)
    report = {
        "preset": args.preset,
        "dtype": args.dtype,
        "cuda_graphs": not args.no_graphs,
        "overlap_steps": not args.no_overlap,
        "wall_s": plain_wall,
        "profiled_wall_s": wall,
        "gpu_busy_s": busy,
        # Kernel time does not grow under the profiler; host time does, so the share of
        # the unprofiled wall time is the closer estimate.
        "gpu_busy_share": busy / plain_wall,
        "tokens_per_s": tokens / plain_wall,
        "kernel_s_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "num_steps": llm.stats().num_steps,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
