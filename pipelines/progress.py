"""How far a run is, counted per token, and when it will finish.

A run's work is its pending shards' tokens: every prompt token plus every completion
token the budget allows (`Shard.num_tokens`). Tokens are counted as the engine does
them - after each engine step (`LLM.generate`'s `on_step`): prompt tokens computed or
served from the prefix cache, tokens generated - so the count moves while a batch of
hundreds of rows is still running, not only when rows finish. The total tightens as
rows finish: a row that stops before its budget takes its unused tokens off the total
(by the job's own budget per row; at the end of a shard the shard's planned tokens are
replaced by what its rows billed, so per-row budgets are exact by then).

    tokens/s   tokens done / seconds since the first engine step of this run
    ETA        tokens left / tokens/s
    cost       the tokens done so far at the job's prices (None when none are set)

Rows count when they finish (copies, and rows that failed before compute, when their
shard is published).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.outputs import EngineStats, RequestOutput
from tokenmill.pipelines.pricing import Prices


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
    seconds: float  # since the first engine step
    tokens_per_s: float | None
    eta_s: float | None
    cost: float | None  # USD of the tokens done; None: no token price set

    @property
    def fraction(self) -> float:
        return self.tokens_done / self.tokens_total if self.tokens_total else 1.0


class ProgressCounter:
    """Counts a run's rows and tokens (see the module docstring).

    Args:
        rows_total: rows of the shards this run computes.
        tokens_total: their planned tokens (prompt + completion budget).
        budget_per_row: the job's completion budget per row (max_tokens x n).
        prices: the job's prices (cost so far), or None.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        rows_total: int,
        tokens_total: int,
        budget_per_row: int = 0,
        prices: Prices | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rows_total = rows_total
        self.tokens_total = tokens_total
        self.budget_per_row = budget_per_row
        self.prices = prices if prices is not None and prices.has_token_prices else None
        self.clock = clock
        self.rows_done = 0
        self.rows_in_shard = 0
        self.tokens_done = 0  # finished shards' billed tokens + the running shard's steps
        self.shard_tokens = 0  # the running shard's tokens so far
        self.shard_cut = 0  # budget its finished rows left unused
        self.prompt_computed = self.prompt_cached = self.generated = 0
        self.started: float | None = None

    def step(self, tokens: StepTokens) -> None:
        """One engine step's tokens."""
        if self.started is None:
            self.started = self.clock()
        self.shard_tokens += tokens.total
        self.prompt_computed += tokens.prompt_computed
        self.prompt_cached += tokens.prompt_cached
        self.generated += tokens.generated

    def request_done(self, output: RequestOutput) -> None:
        """A row finished: it counts, and its unused budget leaves the total."""
        self.rows_in_shard += 1
        if output.error is None and self.budget_per_row:
            self.shard_cut += max(0, self.budget_per_row - output.completion_tokens)

    def shard_done(self, planned_tokens: int, billed_tokens: int, num_rows: int) -> None:
        """A shard is published: its planned tokens give way to what its rows billed."""
        self.tokens_total += billed_tokens - planned_tokens
        self.tokens_done += billed_tokens
        self.rows_done += num_rows
        self.shard_tokens = self.shard_cut = self.rows_in_shard = 0

    def snapshot(self) -> Snapshot:
        """The progress now."""
        total = max(0, self.tokens_total - self.shard_cut)
        done = min(total, self.tokens_done + self.shard_tokens)
        seconds = 0.0 if self.started is None else self.clock() - self.started
        rate = done / seconds if seconds > 0 and done else None
        eta = (total - done) / rate if rate else None
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

    def _cost(self) -> float | None:
        if self.prices is None:
            return None
        p = self.prices
        return (
            self.prompt_computed * p.input
            + self.prompt_cached * p.cached_input
            + self.generated * p.output
        ) / 1e6
