"""What `tokenmill run` shows while a job runs, on stderr.

From the first second a line per stage (planning, loading the model, resuming K of N
shards, writing the ledger), then one bar counted per generated token
(`pipelines/progress.py`): tokens done of the plan's total, rows done, tokens/s, the
ETA from the tokens left, and the cost so far when prices are set. `--json` runs show
none of it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from tokenmill.pipelines.job import JobProgress
from tokenmill.pipelines.progress import ProgressCounter, StepTokens, counter_for

# What the bar says the engine is doing, by the job's task.
_LABELS = {
    "score": "scoring",
    "embed": "embedding",
    "classify": "classifying",
    "rerank": "reranking",
}


def clock(seconds: float | None) -> str:
    """Seconds as H:MM:SS ("-:--:--" when unknown)."""
    if seconds is None:
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


class TerminalProgress(JobProgress):
    """Stage lines, then a bar of tokens (see the module docstring).

    Args:
        enabled: False shows nothing (`--no-progress`, `--json`).
        console: where to draw (default: stderr).
        clock: seconds, monotonic (tests drive it).
        started: when the command started, on `clock` (default: now).
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        console: Console | None = None,
        clock: Any = time.perf_counter,
        started: float | None = None,
    ) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.clock = clock
        self.started = clock() if started is None else started
        self.counter: ProgressCounter | None = None
        self.planned_tokens: dict[str, int] = {}
        self.bar: Progress | None = None
        self.task: Any = None

    def say(self, message: str) -> None:
        """One line, stamped with the seconds since the command started."""
        if self.enabled:
            elapsed = self.clock() - self.started
            self.console.print(f"[dim]{elapsed:6.1f}s[/dim]  {message}", highlight=False)

    def warn(self, message: str) -> None:
        """On stderr even with --no-progress or --json: a job must not pass in silence."""
        self.console.print(f"warning: {message}", highlight=False, markup=False, soft_wrap=True)

    def stage(self, message: str) -> None:
        self._stop_bar()
        self.say(message)

    def planned(self, plan: Any, pending: list) -> None:
        compute = [s for s in plan.shards if not s.is_copy]
        prompt_budget = sum(s.num_tokens for s in compute)
        line = (
            f"planned {plural(plan.num_rows, 'row')} into {plural(len(compute), 'shard')}"
            f" (~{prompt_budget:,} tokens: prompts + completion budget)"
        )
        if plan.rows_deduplicated:
            line += f"; {plural(plan.rows_deduplicated, 'duplicate row')} computed once"
        self.say(line)
        if plan.spec.dry_run:
            return
        done = len(plan.shards) - len(pending)
        if done and pending:
            self.say(f"resuming: {done} of {plural(len(plan.shards), 'shard')} already complete")
        elif done:
            self.say(f"all {plural(done, 'shard')} already complete: nothing to compute")
            return
        self.planned_tokens = {s.shard_id: s.num_tokens for s in pending}
        self.counter = counter_for(plan, pending, clock=self.clock)
        label = _LABELS.get(plan.spec.task, "generating")
        self._start_bar(label)

    def step(self, tokens: StepTokens) -> None:
        if self.counter is not None:
            self.counter.step(tokens)
            self._update()

    def request_done(self, output: Any) -> None:
        if self.counter is not None:
            self.counter.request_done(output)
            self._update()

    def shard_done(self, result: Any) -> None:
        if self.counter is None:
            return
        planned = self.planned_tokens.get(result.shard_id, 0)
        # A shard another run published meanwhile billed what it planned, as far as we know.
        billed = planned if result.skipped else result.prompt_tokens + result.completion_tokens
        self.counter.shard_done(planned, billed, result.num_rows, result.prompt_tokens)
        self._update()

    def close(self) -> None:
        self._stop_bar()

    def line(self) -> str:
        """The bar's figures as text (what the bar shows beside the bar itself)."""
        snap = self.counter.snapshot()
        rate = "-" if snap.tokens_per_s is None else f"{snap.tokens_per_s:,.0f}"
        text = (
            f"{snap.tokens_done:,}/{snap.tokens_total:,} tok  "
            f"{snap.rows_done:,}/{snap.rows_total:,} rows  {rate} tok/s  "
            f"ETA {clock(snap.eta_s)}"
        )
        if snap.cost is not None:
            text += f"  ${snap.cost:,.4f}"
        return text

    def _start_bar(self, label: str) -> None:
        if not self.enabled:
            return
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[figures]}"),
            console=self.console,
            refresh_per_second=4,
        )
        self.bar.start()
        self.task = self.bar.add_task(label, total=1, figures=self.line())

    def _update(self) -> None:
        if self.bar is None:
            return
        snap = self.counter.snapshot()
        self.bar.update(
            self.task,
            completed=snap.tokens_done,
            total=max(1, snap.tokens_total),
            figures=self.line(),
        )

    def _stop_bar(self) -> None:
        if self.bar is not None:
            self._update()
            self.bar.stop()
            self.bar = None
