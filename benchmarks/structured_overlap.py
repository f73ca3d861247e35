"""Does filling grammar masks in a worker thread, while the model runs, pay on this CPU?

    python benchmarks/structured_overlap.py                       # bf16, 64 prompts
    python benchmarks/structured_overlap.py --dtype float32 --runs 2

The default model runs the extract64 prompts constrained (greedy, max_tokens 128) with
the step's masks filled alternately in the worker thread (even steps: overlap) and
inline before the forward pass (odd steps). Consecutive steps are nearly the same work,
so each (overlap, inline) pair of steps with the same number of constrained rows is one
paired comparison - robust to a shared machine's slow drifts, where whole runs A B A B
are not. Reported: the median paired difference in step time, and the medians per mode
of the time the step was held up by masks (waiting for the fill, applying the mask) and
of the fill itself (slower when it shares the cores with the forward pass).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.bench.extract import EXTRACT_SCHEMA, build_extract_workload
from tokenmill.engine import grammar
from tokenmill.engine.core.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--min-rows", type=int, default=16, help="steps with fewer are left out")
    args = parser.parse_args()

    steps: list[tuple[bool, float, int, float, float]] = []
    plain_step = LLMEngine.step

    def alternating_step(engine: LLMEngine):
        overlap = len(steps) % 2 == 0
        grammar.OVERLAP_FILL = overlap
        stats = engine.stats
        rows0, held0, fill0 = (
            stats.num_constrained_tokens,
            stats.grammar_blocking_s,
            stats.grammar_fill_s,
        )
        start = time.perf_counter()
        finished = plain_step(engine)
        steps.append(
            (
                overlap,
                time.perf_counter() - start,
                stats.num_constrained_tokens - rows0,
                stats.grammar_blocking_s - held0,
                stats.grammar_fill_s - fill0,
            )
        )
        return finished

    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    prompt_ids = build_extract_workload(llm.model_dir, num_prompts=args.num_prompts).prompt_ids
    constraint = StructuredOutputs(json=EXTRACT_SCHEMA)
    llm.generate(
        prompt_ids[:2], SamplingParams(temperature=0, max_tokens=4, structured_outputs=constraint)
    )  # warm-up: compiles the schema
    LLMEngine.step = alternating_step
    params = SamplingParams(temperature=0, max_tokens=128, structured_outputs=constraint)
    for run in range(args.runs):
        steps.clear()
        start = time.perf_counter()
        llm.generate(prompt_ids, params)
        wall = time.perf_counter() - start
        pairs = [
            (a[1] - b[1]) / b[1]
            for a, b in zip(steps[::2], steps[1::2])
            if a[2] == b[2] >= args.min_rows
        ]
        print(
            f"run {run + 1}: {wall:.1f} s, {len(pairs)} step pairs; overlap vs inline step "
            f"time, median paired difference {statistics.median(pairs) * 100:+.1f}% "
            f"(load {os.getloadavg()[0]:.2f})"
        )
        for overlap, name in ((True, "overlap"), (False, "inline")):
            mine = [s for s in steps if s[0] == overlap and s[2] >= args.min_rows]
            print(
                f"  {name:8s} held up {statistics.median(s[3] for s in mine) * 1e3:5.2f} ms/step, "
                f"fill {statistics.median(s[4] for s in mine) * 1e3:5.2f} ms/step, "
                f"rows {statistics.median(s[2] for s in mine):.0f}"
            )


if __name__ == "__main__":
    main()
