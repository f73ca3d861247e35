"""What splitting a job over two engines costs the engines: the rows of the 1-worker plan's
compute shards against the same rows as the 2-worker plan cuts them, run one shard after
another on one warm engine in one process, alternating, in CPU seconds.

    python benchmarks/engine_split.py [--rows 480] [--max-tokens 48] [--rounds 3]
        [--engine-option KEY=VALUE]...

The job is benchmarks/dask_fanout.py's (the same input, generation settings and plans:
`plan_job(min_shards=1)` and `plan_job(min_shards=2)`), on the default model with torch
on one thread (`--engine-option` sets an engine setting over the job's, e.g.
max_num_batched_tokens=8192), the prefix cache emptied before each arrangement. Per round it prints each
arrangement's CPU seconds, engine steps, generated tokens and their ratio (split over
whole). Every step's CPU seconds (between two `on_step` calls) are then fitted as
F + v * rows sampled + p * prompt tokens computed over all steps of all rounds: F is
what a step costs whatever its rows (the weights read, the per-layer calls), paid once
per step by each engine; a split that needs more steps for the same rows and prompt
tokens pays F for each extra one. `F * extra steps` against the measured difference
says how much of the split's cost that is.

CPU seconds of one process are what is compared, so a busy machine slows both
arrangements alike; what two engines side by side cost each other (cache, memory
bandwidth, the VM's cores) is benchmarks/core_scaling.py's measure, not this one's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tokenmill.cli.options import parse_key_values
from tokenmill.engine import LLM
from tokenmill.pipelines.planning import load_shard, plan_job
from tokenmill.pipelines.running import shard_rows
from tokenmill.pipelines.spec import JobSpec

sys.path.insert(0, str(Path(__file__).parent))
from forecast_check import write_input  # noqa: E402


@dataclass
class Steps:
    """Per engine step: CPU seconds, rows sampled, prompt tokens computed."""

    cpu_s: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class Arrangement:
    cpu_s: float
    num_steps: int
    generated_tokens: int
    steps: Steps


def shard_prompts(spec: JobSpec, min_shards: int) -> list[tuple[list[list[int]], list]]:
    """The job's compute shards as `min_shards` workers get them: per shard, its rows'
    token ids and sampling parameters, in the shard's order."""
    plan = plan_job(spec, min_shards=min_shards)
    shards = []
    for shard in plan.shards:
        if shard.is_copy:
            continue
        rows = [r for r in shard_rows(load_shard(plan, shard)).rows if r.token_ids is not None]
        shards.append(
            ([list(r.token_ids) for r in rows], [plan.params[r.params_index] for r in rows])
        )
    return shards


def run(llm: LLM, shards: list[tuple[list[list[int]], list]]) -> Arrangement:
    """The shards one after another on `llm`, from an empty prefix cache."""
    llm.reset_prefix_cache()
    steps = Steps()
    last = {}

    def on_step(stats) -> None:
        now = time.process_time()
        steps.cpu_s.append(now - last["cpu"])
        steps.sampled.append(stats.generated_tokens - last["generated"])
        steps.prompt_tokens.append(stats.computed_prompt_tokens - last["computed"])
        last.update(
            cpu=now, generated=stats.generated_tokens, computed=stats.computed_prompt_tokens
        )

    before = llm.stats()
    num_steps, generated = before.num_steps, before.generated_tokens
    started = time.process_time()
    for prompts, params in shards:
        stats = llm.stats()
        last.update(
            cpu=time.process_time(),
            generated=stats.generated_tokens,
            computed=stats.computed_prompt_tokens,
        )
        llm.generate(prompts, params, on_step=on_step)
    cpu_s = time.process_time() - started
    after = llm.stats()
    return Arrangement(
        cpu_s, after.num_steps - num_steps, after.generated_tokens - generated, steps
    )


def fit_steps(runs: list[Arrangement]) -> tuple[np.ndarray, float]:
    """(F, v, p) of cpu = F + v * sampled + p * prompt tokens over every step; and R^2."""
    x = np.array(
        [[1.0, s, p] for r in runs for s, p in zip(r.steps.sampled, r.steps.prompt_tokens)]
    )
    y = np.array([c for r in runs for c in r.steps.cpu_s])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    return coef, 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=480)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each `dask worker --nthreads 1` engine computes
    work = Path(tempfile.mkdtemp(prefix="tokenmill-split-"))
    source = write_input(work / "in.parquet", args.rows)
    arrangements = {}
    for workers in (1, 2):
        spec = JobSpec(
            str(source), str(work / f"out-{workers}"), id_column="id", max_tokens=args.max_tokens
        )
        arrangements[workers] = shard_prompts(spec, workers)
    llm = LLM(
        **{**spec.llm_options, **parse_key_values(args.engine_option, flag="--engine-option")}
    )
    for workers, shards in arrangements.items():
        print(f"{workers} worker(s): compute shards of {[len(p) for p, _ in shards]} rows")
    run(llm, arrangements[2])  # warm-up: first calls, allocator, KV blocks first written
    runs: dict[int, list[Arrangement]] = {1: [], 2: []}
    for round_ in range(args.rounds):
        for workers in (1, 2) if round_ % 2 == 0 else (2, 1):
            runs[workers].append(run(llm, arrangements[workers]))
        whole, split = runs[1][-1], runs[2][-1]
        print(
            f"round {round_ + 1}: whole {whole.cpu_s:.2f} CPU s, {whole.num_steps} steps, "
            f"{whole.generated_tokens} tokens; split {split.cpu_s:.2f} CPU s, "
            f"{split.num_steps} steps, {split.generated_tokens} tokens; "
            f"split / whole {split.cpu_s / whole.cpu_s:.3f}"
        )
    ratios = [s.cpu_s / w.cpu_s for w, s in zip(runs[1], runs[2])]
    print(
        f"split / whole CPU: median {statistics.median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f}"
    )
    (f, v, p), r2 = fit_steps(runs[1] + runs[2])
    print(
        f"per step: F {f * 1e3:.1f} ms + {v * 1e3:.3f} ms a row sampled + "
        f"{p * 1e3:.3f} ms a prompt token (R^2 {r2:.3f})"
    )
    extra_steps = statistics.median(s.num_steps - w.num_steps for w, s in zip(runs[1], runs[2]))
    extra_cpu = statistics.median(s.cpu_s - w.cpu_s for w, s in zip(runs[1], runs[2]))
    print(
        f"the split's extra steps {extra_steps:g} x F = {extra_steps * f:.2f} s, "
        f"of its extra {extra_cpu:.2f} CPU s (medians)"
    )


if __name__ == "__main__":
    main()
