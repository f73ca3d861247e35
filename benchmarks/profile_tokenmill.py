"""Where tokenmill's time goes on a benchmark workload, for one engine configuration or
several side by side.

    python benchmarks/profile_tokenmill.py --preset mixed64 --dtype float32
    python benchmarks/profile_tokenmill.py --dtype bfloat16 --vs quantization=int8 --rounds 5
    python benchmarks/profile_tokenmill.py --dtype bfloat16 --vs huge_pages=true
    python benchmarks/profile_tokenmill.py --preset mixed64 --torch-profiler   # op level

Each configuration is its own engine (`LLM(...)` with the `--engine-option`s, then each
`--vs` option over them); the configurations run the workload in turn, round after round
(A B A B ...), each run timed by `tokenmill.bench.profile.StageTimer` through the
engine's profiling hook (`LLM.set_profiler`): the step stages of engine/types/profiling.py,
with the linear layers, the lm_head and attention as stages of their own. "rest" is the
time outside every stage - Python around the steps, detokenization.

With a second configuration it also prints what the linear layers decide: the run-time
ratio, the ratio of the linear layers' time (L) alone, the L ratio the target `--ratio`
would need given the rest (S), and the ratio if L sped up by the hardware's
`--peak-ratio` (e.g. 2 for int8 against bf16 on AMX).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM
from tokenmill.bench.profile import LINEAR, profile_llm
from tokenmill.bench.timing import alternate, fixed_length_params, timed_generate, warm_up
from tokenmill.bench.workload import PRESETS, load_preset
from tokenmill.cli.options import parse_key_values
from tokenmill.engine import STAGES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mixed64", choices=list(PRESETS))
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--vs", action="append", default=[], metavar="KEY=VALUE",
        help="a second configuration: the first with this option changed (repeatable)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=1.5, help="the target run-time ratio")
    parser.add_argument("--peak-ratio", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--torch-profiler", action="store_true", help="op-level aten table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = {"dtype": args.dtype, **parse_key_values(args.engine_option, flag="--engine-option")}
    configs = {"base": base}
    if args.vs:
        configs[" ".join(args.vs)] = {**base, **parse_key_values(args.vs, flag="--vs")}
    llms = {name: LLM(args.model, **options) for name, options in configs.items()}
    workload = load_preset(args.preset, next(iter(llms.values())).model_dir)
    params = fixed_length_params(workload)
    for llm in llms.values():
        warm_up(llm, workload)

    if args.torch_profiler:
        _torch_profile(llms["base"], workload, params)
        return

    timers = {name: profile_llm(llm) for name, llm in llms.items()}

    def run(name: str):
        def once() -> tuple[float, dict[str, float], int]:
            timer = timers[name]
            timer.reset()
            result = timed_generate(
                llms[name], workload.prompt_ids, params, sequential=workload.sequential
            )
            return result.wall_s, dict(timer.seconds), result.stats.num_steps

        return once

    results = alternate({name: run(name) for name in configs}, args.rounds)
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    print(f"{args.preset}: {workload.num_requests} requests, {tokens:,} tokens; "
          f"threads {torch.get_num_threads()}; {args.rounds} round(s), medians")  # fmt: skip
    for name, runs in results.items():
        _print_config(name, runs, tokens)
    if len(results) == 2:
        _print_bound(results, args.ratio, args.peak_ratio)


def _median_stages(runs) -> dict[str, float]:
    names = {stage for _, seconds, _ in runs for stage in seconds}
    return {n: statistics.median(s.get(n, 0.0) for _, s, _ in runs) for n in names}


def _print_config(name: str, runs, tokens: int) -> None:
    wall = statistics.median(w for w, _, _ in runs)
    steps = statistics.median(n for _, _, n in runs)
    stages = _median_stages(runs)
    print(f"\n[{name}] {wall:.2f} s ({', '.join(f'{w:.2f}' for w, _, _ in runs)}), "
          f"{tokens / wall:,.0f} tok/s, {steps:.0f} steps, {wall / steps * 1e3:.1f} ms/step")  # fmt: skip
    order = [LINEAR, "lm_head", "attention", *STAGES]
    rows = [(s, stages[s]) for s in order if s in stages]
    rows += [(s, t) for s, t in stages.items() if s not in order]
    rows.append(("rest", wall - sum(stages.values())))
    for stage, seconds in rows:
        print(f"  {stage:<14} {seconds:7.2f} s  {seconds / wall:6.1%}")


def _print_bound(results, target: float, peak: float) -> None:
    (a, runs_a), (b, runs_b) = results.items()
    wall_a = statistics.median(w for w, _, _ in runs_a)
    wall_b = statistics.median(w for w, _, _ in runs_b)
    linear_a = _median_stages(runs_a).get(LINEAR, 0.0)
    linear_b = _median_stages(runs_b).get(LINEAR, 0.0)
    rest_b = wall_b - linear_b
    print(f"\n[{b}] against [{a}]: run time {wall_a / wall_b:.2f}x, linear layers "
          f"{linear_a / linear_b:.2f}x")  # fmt: skip
    needed = linear_a / (wall_a / target - rest_b) if wall_a / target > rest_b else float("inf")
    print(f"  a {target:.2f}x run needs the linear layers {needed:.2f}x as fast; at {peak:.2f}x "
          f"they would give {wall_a / (linear_a / peak + rest_b):.2f}x, free ones "
          f"{wall_a / rest_b:.2f}x")  # fmt: skip


def _torch_profile(llm: LLM, workload, params) -> None:
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_generate(llm, workload.prompt_ids, params)
    print(f"{time.perf_counter() - start:.2f} s under the profiler (slower than a real run)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
