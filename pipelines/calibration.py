"""Calibration: a short real run of a sample of a job's own rows, on the machine that
forecasts, to estimate what only computing can tell - how long completions are and
what an engine step costs here.

The sample is spread evenly over the job's rows in run order (so it sees the job's mix
of lengths and prefixes): `SAMPLE_SHARE` of the rows to compute, at least
`MIN_SAMPLE_ROWS` (or every row), at most one engine batch. It runs as one `generate`
call, a few times (the first run pays a fresh engine's one-time set-up, which is
measured as such; the others are timed), and is stopped after `TIME_BOUND_S` in all;
rows the bound cuts off in the first run count at their whole budget (the calibration
reports how many finished).

What it yields:

- each finished row's completion tokens as a fraction of its budget (max_tokens x n):
  the forecast gives every row of the job one of these fractions in turn, so the job's
  estimate has the sample's spread of lengths, not just its mean;
- the cost of an engine step, `StepCost`: seconds = per_step + per_prompt_token x prompt
  tokens computed + per_sampled_token x tokens sampled, fitted by least squares to the
  sample's own steps (timed between `LLM.generate`'s `on_step` calls). A step's work
  is what the engine's counters say it computed, which `LLM.plan(simulate=True)`
  reproduces for the whole job; the forecast's duration is the fitted cost of those
  steps. Extrapolating from the sample's small batches to the job's large ones assumes
  a step's cost grows linearly with its tokens - true of the matrix products that
  dominate a step once a batch is a few dozen tokens wide.

The engine's prefix cache is emptied afterwards (`LLM.reset_prefix_cache`), so a run in
the same process starts as cold as the forecast assumes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.engine import EngineStats, PlannedRequest, RequestOutput, StepLoad

SAMPLE_SHARE = 0.05
MIN_SAMPLE_ROWS = 8
TIME_BOUND_S = 30.0
# Timed runs after the first: at least this many, and at least this many steps in all
# (time allowing), so that noise in one step's time does not set the cost of all.
MIN_TIMED_RUNS = 3
MIN_TIMED_STEPS = 32


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes here, by what it computes (see the module docstring)."""

    per_step: float
    per_prompt_token: float
    per_sampled_token: float

    def seconds(self, steps: Sequence[StepLoad]) -> float:
        """The fitted time of these steps."""
        prompt = sum(s.prompt_tokens for s in steps)
        sampled = sum(s.sampled_tokens for s in steps)
        return (
            len(steps) * self.per_step
            + prompt * self.per_prompt_token
            + sampled * self.per_sampled_token
        )


@dataclass
class Calibration:
    """What a calibration run measured."""

    num_rows: int  # sample rows that finished
    num_rows_sampled: int
    seconds: float  # its wall time
    completion_fractions: list[float]  # per finished row: completion tokens / budget
    step_cost: StepCost
    warm_up_s: float = 0.0  # what a fresh engine's first steps take beyond their cost
    stopped_early: bool = False  # the time bound ended it
    steps: list[tuple[float, StepLoad]] = field(default_factory=list, repr=False)

    def completion_tokens(self, index: int, budget: int) -> int:
        """The completion tokens the forecast gives the `index`-th row to compute, whose
        budget is `budget` (max_tokens x n): the sample's fractions in turn."""
        if budget == 0:
            return 0
        if not self.completion_fractions:
            return budget
        fraction = self.completion_fractions[index % len(self.completion_fractions)]
        return min(budget, max(1, round(fraction * budget)))


def sample_indices(num_rows: int, max_rows: int) -> list[int]:
    """Evenly spaced indices into `num_rows` rows in run order: the calibration sample."""
    if num_rows <= 0:
        return []
    size = min(num_rows, max_rows, max(MIN_SAMPLE_ROWS, math.ceil(SAMPLE_SHARE * num_rows)))
    return sorted({int(i * num_rows / size) for i in range(size)})


class _TimeUp(Exception):
    """Raised from `on_step` to end a calibration run at its time bound."""


@dataclass
class _Run:
    finished: list[RequestOutput]
    steps: list[tuple[float, StepLoad]]
    seconds: float
    stopped_early: bool


def calibrate(
    llm: Any, requests: Sequence[PlannedRequest], *, time_bound_s: float = TIME_BOUND_S
) -> Calibration:
    """Run `requests` (the sample) on `llm`, timing every step; see the module docstring.
    A pooling sample (embed, classify, rerank) has no completions: it gives step costs
    only, through `LLM.encode`.

    The sample runs several times, each from an empty prefix cache: the first run pays
    what a fresh engine pays once (kernels set up on first use) and gives the completion
    lengths; later runs - until `MIN_TIMED_STEPS` steps or `MIN_TIMED_RUNS` runs are
    timed, within the time bound - give the step costs, so a sample of one or two steps
    (a scoring sample) is timed more than once. They run the whole sample and its first
    half in turn, so the timed steps have more than one size. The first run's excess over the fitted
    cost of its steps is the one-time `warm_up_s` a new run adds.

    Args:
        llm: a loaded LLM (`generate` - and `encode` for pooling requests - with
            `on_output` and `on_step`, `stats`, `engine`).
        requests: the sample's prompts and params, in run order.
        time_bound_s: every run stops after this many seconds in all.

    Returns:
        The Calibration.
    """
    deadline = time.perf_counter() + time_bound_s
    cold = _timed_run(llm, requests, deadline)
    # Timed runs alternate the whole sample and its first half: steps of one shape only
    # (a scoring sample is one step) cannot tell a step's fixed cost from its tokens',
    # and the job's steps are larger than the sample's.
    shapes = [requests, requests[: len(requests) // 2] or requests]
    warm: list[_Run] = []
    while not cold.stopped_early and (
        len(warm) < MIN_TIMED_RUNS or sum(len(r.steps) for r in warm) < MIN_TIMED_STEPS
    ):
        run = _timed_run(llm, shapes[len(warm) % 2], deadline)
        if run.stopped_early:
            break
        warm.append(run)
    timed_steps = [step for run in warm for step in run.steps] or cold.steps
    cost = fit_step_cost(timed_steps)
    warm_up = 0.0
    if warm:
        warm_up = max(0.0, cold.seconds - cost.seconds([load for _, load in cold.steps]))
    return Calibration(
        num_rows=len(cold.finished),
        num_rows_sampled=len(requests),
        seconds=cold.seconds + sum(r.seconds for r in warm),
        completion_fractions=_fractions(requests, cold),
        step_cost=cost,
        warm_up_s=warm_up,
        stopped_early=cold.stopped_early,
        steps=timed_steps,
    )


def _fractions(requests: Sequence[PlannedRequest], run: _Run) -> list[float]:
    """Each sample row's completion tokens over its budget. A row the time bound cut off
    counts at its whole budget: rows still generating at the bound are the long ones,
    and leaving them out would forecast the job's completions short."""
    budgets = {tuple(r.token_ids): r.params.max_tokens * r.params.n for r in requests}
    fractions = [
        o.completion_tokens / budgets[tuple(o.prompt_token_ids)]
        for o in run.finished
        if o.error is None and budgets.get(tuple(o.prompt_token_ids))
    ]
    if run.stopped_early:
        fractions += [1.0] * (len(requests) - len(run.finished))
    return fractions


def _timed_run(llm: Any, requests: Sequence[PlannedRequest], deadline: float) -> _Run:
    """The sample's generate (and encode) call, each step timed; the cache emptied after it."""
    finished: list[RequestOutput] = []
    steps: list[tuple[float, StepLoad]] = []
    stats = llm.stats()
    last = [time.perf_counter(), stats.computed_prompt_tokens, stats.generated_tokens]
    started = last[0]

    def on_step(stats: EngineStats) -> None:
        now = time.perf_counter()
        counts = (stats.computed_prompt_tokens, stats.generated_tokens)
        steps.append((now - last[0], StepLoad(counts[0] - last[1], counts[1] - last[2])))
        last[:] = [now, *counts]
        if now > deadline:
            raise _TimeUp

    stopped_early = False
    # As a job's shard runs them (`engine_failures.generate_rows`): generation requests
    # in one `generate` call, then pooling ones in one `encode` call.
    generating = [r for r in requests if not r.is_pooling]
    pooled = [r for r in requests if r.is_pooling]
    try:
        if generating:
            llm.generate(
                [list(r.token_ids) for r in generating],
                [r.params for r in generating],
                on_output=finished.append,
                on_step=on_step,
            )
        if pooled:
            llm.encode(
                [list(r.token_ids) for r in pooled],
                [r.params for r in pooled],
                on_output=finished.append,
                on_step=on_step,
            )
    except _TimeUp:
        stopped_early = True  # LLM.generate dropped the rest
    seconds = time.perf_counter() - started
    llm.reset_prefix_cache()  # what follows starts cold
    return _Run(finished, steps, seconds, stopped_early)


def fit_step_cost(steps: Sequence[tuple[float, StepLoad]]) -> StepCost:
    """Least-squares StepCost of timed steps; a coefficient that fits below zero is
    dropped (the others refitted without it), so every cost is >= 0.

    Steps of the same load (the sample runs more than once, so each of its steps is
    timed several times) count as one point at their median time, weighted by how many
    they are: on a shared machine a step now and then takes many times its usual time
    (another process had the cores), and a mean over those would price every step of
    the job as if each were interrupted - a sample of few, short steps (an encoder's,
    one per run) is forecast several times too slow."""
    if not steps:
        return StepCost(0.0, 0.0, 0.0)
    by_load: dict[tuple[int, int], list[float]] = {}
    for t, load in steps:
        by_load.setdefault((load.prompt_tokens, load.sampled_tokens), []).append(t)
    weights = np.sqrt([len(times) for times in by_load.values()])
    seconds = np.array([float(np.median(times)) for times in by_load.values()]) * weights
    features = np.array([[1.0, p, g] for p, g in by_load], dtype=float) * weights[:, None]
    active = [0, 1, 2]
    coefficients = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active = [a for a, c in zip(active, solution) if c >= 0] or []
    return StepCost(*(float(c) for c in coefficients))
