"""What scoring costs: a workload's prompts with and without prompt log-probabilities.

"plain" and "scored" generate one token per prompt (greedy); "plain" takes shared
prefixes from the prefix cache, "scored" asks for prompt_logprobs=0, so every prompt
token is scored - a cached prefix is computed again for it (engine/sample/prompt_logprobs.py)
and every prompt row goes through the lm_head. "prompt-only" is a scoring job's request
(max_tokens=0, prompt_logprobs=0): scored the same, with no token sampled. They
alternate in one process over fresh engines per run (same weights), so the differences
are the price of exact scores and what sampling nothing saves.

Run:  python benchmarks/prompt_logprobs_cost.py [--preset mixed64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM, SamplingParams
from tokenmill.bench.timing import alternate, timed_generate, warm_up
from tokenmill.bench.workload import load_preset

MODES = {
    "plain": SamplingParams(temperature=0, max_tokens=1),
    "scored": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
    "prompt-only": SamplingParams(max_tokens=0, prompt_logprobs=0),
}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """(wall seconds, prompt tokens computed, prompt tokens served from the cache)."""
    result = timed_generate(llm, prompts, params)
    return result.wall_s, result.stats.computed_prompt_tokens, result.stats.cached_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mixed64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    workload = load_preset(args.preset, llm.model_dir)

    def case(mode: str):
        def once() -> tuple[float, int, int]:
            # A fresh cache each run: the previous run's blocks would be hits.
            fresh = LLM(dtype=args.dtype)
            warm_up(fresh, workload)
            return run(fresh, workload.prompt_ids, MODES[mode])

        return once

    results = alternate({mode: case(mode) for mode in MODES}, args.rounds)
    print(
        f"# {args.preset}: {workload.num_requests} prompts, {workload.num_prompt_tokens:,} "
        f"prompt tokens, {args.dtype}, 1 generated token each (prompt-only: none)"
    )
    print("| run | wall s (median) | prompt tokens computed / cached |")
    print("|---|---:|---:|")
    for mode, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        print(f"| {mode} | {wall:.2f} | {runs[0][1]:,} / {runs[0][2]:,} |")
    plain = statistics.median(r[0] for r in results["plain"])
    scored = statistics.median(r[0] for r in results["scored"])
    prompt_only = statistics.median(r[0] for r in results["prompt-only"])
    print(f"\nscored / plain: {scored / plain:.2f}x")
    print(f"prompt-only / scored: {prompt_only / scored:.2f}x")


if __name__ == "__main__":
    main()
