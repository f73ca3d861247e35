"""What repetition, presence and frequency penalties cost a whole workload.

Runs a preset (default mixed64) greedy with each request's fixed output length, with and
without penalties on every request, so both generate the same number of tokens whatever
the penalties change. Each run is a fresh engine (mixed64's shared prefix is computed
once per run, as in a fresh job); runs alternate A B A B (`tokenmill.bench.timing.
alternate`) and the medians are compared as ratios: of wall time, of this process's
CPU time (which other work on a shared machine disturbs less), and of the two step
stages the penalties add work to, timed through the engine's profiling hook
(`LLM.set_profiler`): `prepare` (their inputs built on the host and uploaded) and
`sample` (applied to the logits) - the penalties' own cost, apart from the model.

Run:  python benchmarks/penalties_cost.py [--preset mixed64] [--dtype auto] [--rounds 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
from dataclasses import dataclass

from tokenmill import LLM
from tokenmill.bench.profile import StageTimer
from tokenmill.bench.result import Stopwatch, load_avg_1m
from tokenmill.bench.timing import alternate, fixed_length_params, warm_up
from tokenmill.bench.workload import PRESETS, load_preset

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)
STAGES = ("prepare", "sample")


@dataclass
class Run:
    wall_s: float
    cpu_s: float
    stage_s: dict[str, float]  # the STAGES' seconds


def timed_run(dtype: str, workload, penalized: bool) -> Run:
    """One generate over the whole workload on a fresh engine."""
    llm = LLM(dtype=dtype)
    warm_up(llm, workload)
    params = fixed_length_params(workload, **(PENALTIES if penalized else {}))
    timer = StageTimer()
    llm.set_profiler(timer)
    with Stopwatch() as clock:
        outputs = llm.generate(workload.prompt_ids, params)
    if any(o.error is not None for o in outputs):
        raise RuntimeError("a request failed")
    if sum(len(o.outputs[0].token_ids) for o in outputs) != workload.num_output_tokens:
        raise RuntimeError("the runs did not generate the workload's tokens")
    return Run(clock.wall_s, clock.cpu_s, {s: timer.seconds.get(s, 0.0) for s in STAGES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mixed64", choices=list(PRESETS))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    workload = load_preset(args.preset, LLM(dtype=args.dtype).model_dir)
    runs = alternate(
        {
            "plain": lambda: timed_run(args.dtype, workload, penalized=False),
            "penalized": lambda: timed_run(args.dtype, workload, penalized=True),
        },
        args.rounds,
    )
    print(
        f"{args.preset}: {workload.num_requests} requests, {workload.num_output_tokens:,} "
        f"output tokens; dtype {args.dtype}; {args.rounds} rounds A B; "
        f"{platform.processor() or platform.machine()}; load {load_avg_1m():.2f}"
    )
    print(f"penalties: {PENALTIES}")
    print("| run | wall s (each) | CPU s | prepare s | sample s | output tok/s |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for mode, results in runs.items():
        wall = statistics.median(r.wall_s for r in results)
        cpu = statistics.median(r.cpu_s for r in results)
        stages = {s: statistics.median(r.stage_s[s] for r in results) for s in STAGES}
        medians[mode] = (wall, cpu, stages)
        each = ", ".join(f"{r.wall_s:.2f}" for r in results)
        print(
            f"| {mode} | {wall:.2f} ({each}) | {cpu:.2f} | {stages['prepare']:.3f} "
            f"| {stages['sample']:.3f} | {workload.num_output_tokens / wall:,.0f} |"
        )
    (plain_wall, plain_cpu, plain_st), (pen_wall, pen_cpu, pen_st) = medians.values()
    added = sum(pen_st.values()) - sum(plain_st.values())
    print(
        f"penalized / plain: wall {pen_wall / plain_wall:.3f}, CPU {pen_cpu / plain_cpu:.3f}; "
        f"prepare + sample add {added:.3f} s = {added / plain_wall:.1%} of the plain wall"
    )


if __name__ == "__main__":
    main()
