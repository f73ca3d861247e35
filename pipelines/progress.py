"""How far a run is, counted per token, and when it will finish.

A run's work is its pending shards' tokens: every prompt token plus every completion
token the budget allows (`Shard.num_tokens`). Tokens are counted as the engine does
them - after each engine step (`LLM.generate`'s `on_step`): prompt tokens computed or
served from the prefix cache, tokens generated - so the count moves while a batch of
hundreds of rows is still running, not only when rows finish. The total tightens as
rows finish: a row that stops before its budget takes its unused tokens off the total
(by the job's own budget per row; at the end of a shard the shard's planned tokens are
replaced by what its rows billed, so per-row budgets are exact by then).

Tokens are not all alike in time: a cached prompt token costs nothing, and a job does
most of its prompts first, two thousand to a step, then generates a token per row per
step, each step paying its own fixed costs (reading every weight, scheduling). So the
ETA is not tokens left over the rate so far (early on that rate, inflated by prompts
and cache hits, would promise the end far too soon). Each step's seconds are fitted, by
least squares over the steps so far, as `per_step + per_token x tokens computed`
(prompt tokens computed plus tokens generated: the same matrix products), and the ETA
prices what is left: the prompt tokens still to compute (at the cache hit rate so far),
the completion budget still open, and the steps these take (prompts
`max_num_batched_tokens` a step, completions one per unfinished row, `max_num_seqs`
rows at a time). Once every prompt is computed, what is left is decode steps, and they
are priced at the median of the last `RECENT_STEPS` decode steps instead: a step or
two held up by something else on the machine then moves the ETA little. Until a row
finishes short of its budget the whole budget counts, so the ETA leans long rather
than short.

    tokens/s   the run's average: all its tokens over the seconds they take in all
               (elapsed + ETA) - what the job will have averaged, as the ledger counts it
    ETA        the fitted seconds of the work left (tokens left over the rate so far
               until two steps are timed)
    cost       the tokens done so far at the job's prices (None when none are set)

Rows count when they finish (copies, and rows that failed before compute, when their
shard is published).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.engine import MAX_RUNNING_SEQS, EngineConfig, EngineStats, RequestOutput
from tokenmill.pipelines.pricing import Prices

# The engine's defaults: prompt tokens and rows one step takes at most.
STEP_TOKENS = EngineConfig.max_num_batched_tokens
STEP_ROWS = MAX_RUNNING_SEQS
# Decode steps whose median prices the decode steps left (at least half of them seen).
RECENT_STEPS = 10


@dataclass(frozen=True)
class StepTokens:
    """The tokens one engine step did."""

    prompt_computed: int = 0
    prompt_cached: int = 0
    generated: int = 0

    @property
    def total(self) -> int:
        return self.prompt_computed + self.prompt_cached + self.generated


def step_counter(before: EngineStats | None = None) -> Callable[[EngineStats], StepTokens]:
    """Turns the engine's cumulative counters, seen after each step, into each step's
    tokens. `before`: the counters before the first step (else that step counts none)."""
    last: list[int] | None = None if before is None else _counts(before)

    def delta(stats: EngineStats) -> StepTokens:
        nonlocal last
        now = _counts(stats)
        previous = last if last is not None else now
        last = now
        return StepTokens(*(a - b for a, b in zip(now, previous)))

    return delta


def _counts(stats: EngineStats) -> list[int]:
    return [stats.computed_prompt_tokens, stats.cached_prompt_tokens, stats.generated_tokens]


@dataclass(frozen=True)
class Snapshot:
    """A run's progress at one moment."""

    rows_done: int
    rows_total: int
    tokens_done: int
    tokens_total: int
    seconds: float  # since the run's compute started
    tokens_per_s: float | None
    eta_s: float | None
    cost: float | None  # USD of the tokens done; None: no token price set

    @property
    def fraction(self) -> float:
        return self.tokens_done / self.tokens_total if self.tokens_total else 1.0


class StepTimes:
    """Least squares of step seconds on (1, tokens computed), kept as running sums so
    each fit costs the same however many steps there were."""

    def __init__(self) -> None:
        self.xtx = np.zeros((2, 2))
        self.xty = np.zeros(2)
        self.num_steps = 0

    def add(self, seconds: float, num_tokens: int) -> None:
        x = np.array([1.0, num_tokens])
        self.xtx += np.outer(x, x)
        self.xty += seconds * x
        self.num_steps += 1

    def fit(self) -> np.ndarray | None:
        """(per step, per token), each >= 0; None until two steps are timed (a job's
        first step takes one row's prompt, the next a full budget: the two already tell a
        step's fixed cost from its tokens'). A coefficient that fits below zero is dropped."""
        if self.num_steps < 2:
            return None
        active = [0, 1]
        while active:
            sub = self.xtx[np.ix_(active, active)]
            try:
                solution = np.linalg.lstsq(sub, self.xty[active], rcond=None)[0]
            except np.linalg.LinAlgError:
                return None
            if (solution >= 0).all():
                coefficients = np.zeros(2)
                coefficients[active] = solution
                return coefficients
            active = [a for a, c in zip(active, solution) if c >= 0]
        return None


class ProgressCounter:
    """Counts a run's rows and tokens and prices what is left (see the module docstring).

    Args:
        rows_total: rows of the shards this run computes.
        rows_to_compute: of those, rows the engine runs (default: all; copy shards'
            rows take answers, they do not decode).
        tokens_total: their planned tokens (prompt + completion budget).
        prompt_total: of those, the prompt tokens.
        budget_per_row: the job's completion budget per row (max_tokens x n).
        prices: the job's prices (cost so far), or None.
        step_tokens, step_rows: the engine's token budget and row limit per step.
        clock: seconds, monotonic; the run's compute starts when the counter is made.
    """

    def __init__(
        self,
        *,
        rows_total: int,
        tokens_total: int,
        rows_to_compute: int | None = None,
        prompt_total: int = 0,
        budget_per_row: int = 0,
        prices: Prices | None = None,
        step_tokens: int = STEP_TOKENS,
        step_rows: int = STEP_ROWS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rows_total = rows_total
        self.rows_to_compute = rows_total if rows_to_compute is None else rows_to_compute
        self.rows_computed = 0  # rows the engine finished
        self.tokens_total = tokens_total
        self.prompt_total = prompt_total
        self.budget_per_row = budget_per_row
        self.prices = prices if prices is not None and prices.has_token_prices else None
        self.step_tokens, self.step_rows = step_tokens, step_rows
        self.clock = clock
        self.rows_done = 0
        self.rows_in_shard = 0
        self.tokens_done = 0  # finished shards' billed tokens
        self.prompt_done = 0  # finished shards' billed prompt tokens
        self.shard_prompt = 0  # the running shard's prompt tokens so far (computed + cached)
        self.shard_generated = 0  # ... and tokens generated
        self.shard_cut = 0  # budget its finished rows left unused
        self.prompt_computed = self.prompt_cached = self.generated = 0
        self.times = StepTimes()
        self.decode_steps: deque[float] = deque(maxlen=RECENT_STEPS)  # seconds
        self.started = self.last_step = clock()

    def step(self, tokens: StepTokens) -> None:
        """One engine step's tokens."""
        now = self.clock()
        seconds = now - self.last_step
        self.times.add(seconds, tokens.prompt_computed + tokens.generated)
        if tokens.generated and not tokens.prompt_computed:
            self.decode_steps.append(seconds)
        self.last_step = now
        self.shard_prompt += tokens.prompt_computed + tokens.prompt_cached
        self.shard_generated += tokens.generated
        self.prompt_computed += tokens.prompt_computed
        self.prompt_cached += tokens.prompt_cached
        self.generated += tokens.generated

    def request_done(self, output: RequestOutput) -> None:
        """A row finished: it counts, and its unused budget leaves the total."""
        self.rows_in_shard += 1
        self.rows_computed += 1
        if output.error is None and self.budget_per_row:
            self.shard_cut += max(0, self.budget_per_row - output.completion_tokens)

    def shard_done(
        self, planned_tokens: int, billed_tokens: int, num_rows: int, billed_prompt: int = 0
    ) -> None:
        """A shard is published: its planned tokens give way to what its rows billed."""
        self.tokens_total += billed_tokens - planned_tokens
        self.tokens_done += billed_tokens
        self.prompt_done += billed_prompt
        self.rows_done += num_rows
        self.shard_prompt = self.shard_generated = self.shard_cut = self.rows_in_shard = 0
        self.last_step = self.clock()  # the next step's time excludes the shard's writes

    def snapshot(self) -> Snapshot:
        """The progress now."""
        total = max(0, self.tokens_total - self.shard_cut)
        done = min(total, self.tokens_done + self.shard_prompt + self.shard_generated)
        seconds = self.clock() - self.started
        eta = self._eta(total, done, seconds)
        rate = None
        if eta is not None and seconds + eta > 0:
            rate = total / (seconds + eta)
        return Snapshot(
            rows_done=min(self.rows_total, self.rows_done + self.rows_in_shard),
            rows_total=self.rows_total,
            tokens_done=done,
            tokens_total=total,
            seconds=seconds,
            tokens_per_s=rate,
            eta_s=eta,
            cost=self._cost(),
        )

    def _eta(self, total: int, done: int, seconds: float) -> float | None:
        if done >= total:
            return 0.0
        if done == 0 or seconds <= 0:
            return None
        costs = self.times.fit()
        if costs is None:
            return (total - done) * seconds / done
        per_step, per_token = costs
        prompt_left = max(0, self.prompt_total - self.prompt_done - self.shard_prompt)
        seen = self.prompt_computed + self.prompt_cached
        to_compute = prompt_left * (self.prompt_computed / seen if seen else 1.0)
        generated_left = max(0, total - done - prompt_left)
        rows_left = max(1, self.rows_to_compute - self.rows_computed)
        decode_steps_left = generated_left / min(rows_left, self.step_rows)
        if to_compute < 1 and len(self.decode_steps) > RECENT_STEPS // 2:
            return decode_steps_left * float(np.median(self.decode_steps))
        steps_left = to_compute / self.step_tokens + decode_steps_left
        return per_step * steps_left + per_token * (to_compute + generated_left)

    def _cost(self) -> float | None:
        if self.prices is None:
            return None
        p = self.prices
        return (
            self.prompt_computed * p.input
            + self.prompt_cached * p.cached_input
            + self.generated * p.output
        ) / 1e6


def counter_for(
    plan: Any, shards: Sequence[Any], *, clock: Callable[[], float] = time.perf_counter
):
    """A ProgressCounter for running `shards` of a planned job."""
    spec = plan.spec
    sampling = spec.sampling
    engine = spec.engine_options
    return ProgressCounter(
        rows_total=sum(s.num_rows for s in shards),
        rows_to_compute=sum(s.num_rows for s in shards if not s.is_copy),
        tokens_total=sum(s.num_tokens for s in shards),
        prompt_total=sum(s.num_prompt_tokens for s in shards),
        budget_per_row=sampling.max_tokens * sampling.n,
        prices=spec.prices,
        step_tokens=int(engine.get("max_num_batched_tokens") or STEP_TOKENS),
        step_rows=int(engine.get("max_num_seqs") or STEP_ROWS),
        clock=clock,
    )
