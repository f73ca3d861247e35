"""What two engines on two cores can give at most: the same single-threaded engine job
pinned to one core alone, then one copy on each core at once.

    python benchmarks/core_scaling.py [--rows 96] [--max-tokens 48] [--rounds 3]

Each copy is a fresh process (`taskset -c CORE`, torch on one thread) that loads the
default model and generates the same rows; it reports the seconds of its generate call.
Two cores shared by two engines slow each other (memory bandwidth, the last-level cache,
clocks, and on a VM perhaps hyperthreads of one physical core the guest cannot see), so
with t1 the time alone and t2 the slower of the pair, 2 * t1 / t2 bounds what 2 workers
can gain over 1 on this machine: the Dask fan-out's ratio (benchmarks/dask_fanout.py)
cannot pass it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time, torch
torch.set_num_threads(1)
from tokenmill import LLM, SamplingParams
rows, max_tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM()
prompts = [f"Write a short note about item {i} and its uses." for i in range(rows)]
params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
llm.generate(prompts[:2], params)  # warm
start = time.perf_counter()
llm.generate(prompts, params)
print(json.dumps({"generate_s": time.perf_counter() - start}))
"""


def run(cores: list[int], rows: int, max_tokens: int) -> list[float]:
    """Start one copy per core at once; their generate seconds."""
    children = [
        subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", CHILD, str(rows), str(max_tokens)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for core in cores
    ]
    return [
        json.loads(child.communicate()[0].strip().splitlines()[-1])["generate_s"]
        for child in children
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    bounds = []
    for round_ in range(args.rounds):
        alone = run(cores[:1], args.rows, args.max_tokens)[0]
        pair = run(cores, args.rows, args.max_tokens)
        bound = 2 * alone / max(pair)
        bounds.append(bound)
        print(json.dumps({"round": round_, "alone_s": round(alone, 2),
                          "together_s": [round(t, 2) for t in pair],
                          "bound_2_over_1": round(bound, 2)}), flush=True)  # fmt: skip
    print(json.dumps({"bounds": [round(b, 2) for b in sorted(bounds)],
                      "median": round(statistics.median(bounds), 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
