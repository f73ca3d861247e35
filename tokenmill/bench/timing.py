"""Timing helpers the benchmark scripts share: generation over a workload, alternating
configurations, and the best time of a repeated call."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.bench.workload import Workload, warmup_prompts
from tokenmill.engine import SamplingParams


@dataclass
class GenerateRun:
    """One timed `LLM.generate`: its wall time, outputs and the engine counters it moved."""

    wall_s: float
    outputs: list
    stats: Any  # EngineStats of this run alone (after minus before)


def fixed_length_params(workload: Workload, **overrides: Any) -> list:
    """Greedy SamplingParams giving each request exactly its workload output length."""
    return [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **overrides)
        for n in workload.output_lens
    ]


def warm_up(llm: Any, workload: Workload) -> None:
    """A few short requests of the workload's shape, so kernels and caches are ready."""
    llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))


def timed_generate(
    llm: Any, prompts: Sequence, params: Any, *, sequential: bool = False
) -> GenerateRun:
    """Time one `llm.generate(prompts, params)` - or, `sequential`, one call per prompt in
    turn (a workload run one request at a time); fails if any request errored."""
    before = replace(llm.stats())
    start = time.perf_counter()
    if sequential:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        outputs = [out for p, q in zip(prompts, per_prompt) for out in llm.generate([p], [q])]
    else:
        outputs = llm.generate(list(prompts), params)
    wall = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    after = llm.stats()
    delta = replace(after, **{k: getattr(after, k) - getattr(before, k) for k in _COUNTERS})
    return GenerateRun(wall, outputs, delta)


_COUNTERS = (
    "num_requests",
    "prompt_tokens",
    "computed_prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
    "num_preemptions",
    "num_steps",
    "num_errors",
    "num_constrained_tokens",
    "grammar_fill_s",
    "grammar_blocking_s",
)


def alternate(cases: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """Run every case once per round, in turn (A B A B ...): on a shared machine a load
    that comes and goes then falls on all of them alike. Returns each case's results."""
    results: dict[str, list[Any]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            results[name].append(case())
    return results


def best_of(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """The best wall time of each call over `repeats` rounds, the calls interleaved."""
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_per_call(call: Callable[[], object], min_seconds: float = 0.05) -> float:
    """Seconds per call, calling it until min_seconds have passed (once to warm up)."""
    call()
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls
