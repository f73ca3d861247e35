"""What scoring costs: a workload's prompts with and without prompt log-probabilities.

"plain" and "scored" generate one token per prompt (greedy); "plain" takes shared
prefixes from the prefix cache, "scored" asks for prompt_logprobs=0, so every prompt
token is scored - a cached prefix is computed again for it (engine/worker/prompt_logprobs.py)
and every prompt row goes through the lm_head. "prompt-only" is a scoring job's request
(max_tokens=0, prompt_logprobs=0): scored the same, with no token sampled. They
alternate in one process over fresh engines per run (same weights), so the differences
are the price of exact scores and what sampling nothing saves.

Run:  python benchmarks/prompt_logprobs_cost.py [--preset mixed64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import load_preset, warmup_prompts

MODES = {
    "plain": SamplingParams(temperature=0, max_tokens=1),
    "scored": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
    "prompt-only": SamplingParams(max_tokens=0, prompt_logprobs=0),
}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """(wall seconds, prompt tokens computed, prompt tokens served from the cache)."""
    before = llm.stats()
    computed, cached = before.computed_prompt_tokens, before.cached_prompt_tokens
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    after = llm.stats()
    return wall, after.computed_prompt_tokens - computed, after.cached_prompt_tokens - cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mixed64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    workload = load_preset(args.preset, llm.model_dir)
    results: dict[str, list[tuple[float, int, int]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in results:
            # A fresh cache each run: the previous run's blocks would be hits.
            llm = LLM(dtype=args.dtype)
            llm.generate(warmup_prompts(workload), SamplingParams(max_tokens=2))
            results[mode].append(run(llm, workload.prompt_ids, MODES[mode]))
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
