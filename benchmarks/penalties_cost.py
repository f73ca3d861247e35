"""What penalties cost: a workload with and without them, alternately, in one process.

"plain" is the bench's own tokenmill run (greedy, each request generates exactly its
output length); "penalized" is the same with a repetition, presence and frequency penalty
on every request - the costliest case, since the repetition penalty also lists each
prompt's distinct tokens every step. EOS is ignored, so both generate the same number of
tokens whatever the penalties change. Runs alternate A B A B over fresh engines (a cold
prefix cache each run), and the medians are compared as a ratio - of wall time and of
this process's CPU time, which other work on a shared machine disturbs less.

`--per-step` also times, apart from the model, what the penalties add to one decode step
of the workload: the penalty inputs built on the host and applied to [64, vocab] fp32
logits (the minimum of 20 runs at each of the 64 decode positions, summed), against
the plain runs' median wall time - a figure a noisy machine disturbs far less than the
whole-run ratio.

Run:  python benchmarks/penalties_cost.py [--preset mixed64] [--dtype auto] [--rounds 3]
      [--per-step]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.result import Stopwatch, load_avg_1m
from tokenmill.bench.workload import load_preset, warmup_prompts
from tokenmill.engine.core.step import Sequence
from tokenmill.engine.worker.logit_controls import LogitControls, PenaltyScratch

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)


def timed_run(dtype: str, workload, penalized: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one generate over the whole workload, on a fresh engine."""
    llm = LLM(dtype=dtype)
    extra = PENALTIES if penalized else {}
    llm.generate(warmup_prompts(workload), SamplingParams(temperature=0, max_tokens=4, **extra))
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)
        for n in workload.output_lens
    ]
    with Stopwatch() as clock:
        outputs = llm.generate(workload.prompt_ids, params)
    assert all(o.error is None for o in outputs)
    return clock.wall_s, clock.cpu_s


def penalty_seconds_per_run(workload, vocab_size: int) -> float:
    """Host + sampler seconds the penalties add over the workload's decode steps: every
    request decoding together, position by position (min of 20 runs per position)."""
    params = SamplingParams(temperature=0, **PENALTIES)
    device = torch.device("cpu")
    scratch = PenaltyScratch()
    total = 0.0
    for position in range(max(workload.output_lens)):
        seqs = [
            Sequence(i, str(i), 0, ids + ids[:1] * position, len(ids), params)
            for i, (ids, n) in enumerate(zip(workload.prompt_ids, workload.output_lens))
            if position < n
        ]
        logits = torch.randn(len(seqs), vocab_size)
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            controls = LogitControls.build(seqs, [[] for _ in seqs], device)
            controls.apply_before_mask(logits, scratch)
            best = min(best, time.perf_counter() - start)
        total += best
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mixed64")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-step", action="store_true")
    args = parser.parse_args()
    probe = LLM(dtype=args.dtype)
    workload = load_preset(args.preset, probe.model_dir)
    vocab_size = probe.engine.vocab_size
    del probe
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "penalized": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(timed_run(args.dtype, workload, mode == "penalized"))
            wall, cpu = runs[mode][-1]
            print(f"{mode:10s} wall {wall:.2f} s  cpu {cpu:.2f} s  load {load_avg_1m():.1f}")
    medians = {
        mode: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
        for mode, r in runs.items()
    }
    print(
        f"# {args.preset}: {workload.num_requests} prompts, {workload.num_output_tokens:,} "
        f"generated tokens, dtype {args.dtype}, {platform.processor() or platform.machine()}"
    )
    print(f"# penalties: {PENALTIES}")
    print(f"| run | wall s (median of {args.rounds}) | CPU s | tokens/s |")
    print("|---|---|---|---|")
    for mode, (wall, cpu) in medians.items():
        print(f"| {mode} | {wall:.2f} | {cpu:.2f} | {workload.num_output_tokens / wall:,.0f} |")
    (plain_wall, plain_cpu), (pen_wall, pen_cpu) = medians["plain"], medians["penalized"]
    print(f"penalized / plain: wall {pen_wall / plain_wall:.3f}, CPU {pen_cpu / plain_cpu:.3f}")
    if args.per_step:
        added = penalty_seconds_per_run(workload, vocab_size)
        print(
            f"penalties per run, apart from the model: {added:.3f} s "
            f"= {added / plain_wall:.1%} of the plain median wall"
        )


if __name__ == "__main__":
    main()
