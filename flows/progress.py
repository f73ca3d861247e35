"""A flow's progress, for a person watching the Prefect UI.

Shard tasks may run in other processes or on other machines, so each one records its
progress where every part of the job already meets - the output:
`OUTPUT/_progress/<shard id>.json`, rewritten at most every `RECORD_EVERY_S` while the
shard runs (counted per engine step, `pipelines/progress.py`) and once when it ends.
The flow's own process reads the records while it waits for its shards - whenever a
shard ends, and at least every `PUBLISH_EVERY_S` - and publishes the job's progress
artifact: rows and tokens done of the total, tokens/s, ETA and the cost so far. A
long shard also logs a line every `LOG_EVERY_S`. The records go when the job finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from tokenmill.connectors.store_retries import is_store_error
from tokenmill.engine import EngineStats, RequestOutput
from tokenmill.pipelines import output as out
from tokenmill.pipelines import report
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan
from tokenmill.pipelines.progress import Snapshot, counter_for, step_counter
from tokenmill.pipelines.running import ShardResult

RECORD_EVERY_S = 5.0
PUBLISH_EVERY_S = 5.0
LOG_EVERY_S = 30.0


class ShardReporter:
    """Counts one shard task's progress and records it (see the module docstring).

    Args:
        plan: the job plan.
        shard: the shard this task runs.
        logger: the task run's logger.
        before: the engine's counters before the shard (None: not known).
        clock: wall seconds (records from several machines are compared).
    """

    def __init__(
        self,
        plan: JobPlan,
        shard: Shard,
        logger: logging.Logger | logging.LoggerAdapter,
        *,
        before: EngineStats | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.plan, self.shard, self.logger, self.clock = plan, shard, logger, clock
        self.counter = counter_for(plan, [shard], clock=clock)
        self.tokens = step_counter(before)
        self.started = clock()
        self.recorded = self.logged = self.started

    def step(self, stats: EngineStats) -> None:
        """`LLM.generate`'s on_step."""
        self.counter.step(self.tokens(stats))
        now = self.clock()
        if now - self.recorded >= RECORD_EVERY_S:
            self._record(done=False)
        if now - self.logged >= LOG_EVERY_S:
            self.logged = now
            self.logger.info("shard %s: %s", self.shard.shard_id, _line(self.counter.snapshot()))

    def request_done(self, output: RequestOutput) -> None:
        self.counter.request_done(output)

    def finish(self, result: ShardResult) -> Snapshot:
        """The shard ended: its final record, from what its part bills."""
        billed = result.prompt_tokens + result.completion_tokens
        if result.skipped:
            billed = self.shard.num_tokens
        self.counter.shard_done(
            self.shard.num_tokens, billed, result.num_rows, result.prompt_tokens
        )
        self._record(done=True)
        return self.counter.snapshot()

    def _record(self, *, done: bool) -> None:
        self.recorded = self.clock()
        snap = self.counter.snapshot()
        record = {
            "rows_done": snap.rows_done,
            "tokens_done": snap.tokens_done,
            "tokens_total": snap.tokens_total,
            "prompt_computed": self.counter.prompt_computed,
            "prompt_cached": self.counter.prompt_cached,
            "generated": self.counter.generated,
            "started": self.started,
            "updated": self.recorded,
            "eta_s": snap.eta_s,
            "done": done,
        }
        spec = self.plan.spec
        try:
            out.write_progress(spec.output, self.shard.shard_id, record, spec.storage_options)
        except OSError as exc:  # progress is for people; the shard's work goes on
            self.logger.warning("shard %s: could not record progress: %s", self.shard.shard_id, exc)


def shard_line(result: ShardResult, seconds: float, cost: float | None) -> str:
    """A finished shard's log line: rows, tokens, tokens/s and cost."""
    tokens = result.prompt_tokens + result.completion_tokens
    rate = tokens / seconds if seconds > 0 else None
    return (
        f"{result.num_rows:,} rows ({result.rows_failed:,} failed), {tokens:,} tokens "
        f"({result.prompt_tokens:,} prompt, {result.cached_tokens:,} cached, "
        f"{result.completion_tokens:,} completion) in {seconds:,.2f} s, "
        f"{report.rate(rate)}, cost {report.money(cost) if cost is not None else report.NO_PRICES}"
    )


def _line(snap: Snapshot) -> str:
    return (
        f"{snap.rows_done:,}/{snap.rows_total:,} rows, {snap.tokens_done:,}/"
        f"{snap.tokens_total:,} tokens, {report.rate(snap.tokens_per_s)}"
    )


def job_snapshot(
    plan: JobPlan,
    pending: Iterable[Shard],
    records: dict[str, dict],
    *,
    now: float,
    workers: int = 1,
) -> Snapshot:
    """The job's progress from its pending shards' records (a shard without one has not
    started: all its planned tokens are still to do).

    Its ETA: the running shards' own ETAs, and the unstarted shards' planned tokens at
    the seconds per planned token the started shards take (elapsed plus ETA), spread
    over the workers - never sooner than the slowest running shard.
    """
    pending = list(pending)
    rows_done = tokens_done = tokens_total = 0
    computed = cached = generated = 0
    starts = []
    timed_seconds = timed_tokens = 0.0
    running_eta: list[float] = []
    unstarted = 0
    for shard in pending:
        record = records.get(shard.shard_id)
        if record is None:
            tokens_total += shard.num_tokens
            unstarted += shard.num_tokens
            continue
        rows_done += record["rows_done"]
        tokens_done += record["tokens_done"]
        tokens_total += record["tokens_total"]
        computed += record["prompt_computed"]
        cached += record["prompt_cached"]
        generated += record["generated"]
        starts.append(record["started"])
        eta = record.get("eta_s")
        if record.get("done"):
            eta = 0.0
        elif eta is not None:
            eta = max(0.0, eta - (now - record["updated"]))  # the record's age is spent
            running_eta.append(eta)
        if eta is not None and shard.num_tokens:
            timed_seconds += record["updated"] - record["started"] + eta
            timed_tokens += shard.num_tokens
    seconds = now - min(starts) if starts else 0.0
    eta = None
    if tokens_done >= tokens_total:
        eta = 0.0
    elif timed_tokens:
        queued = sum(running_eta) + unstarted * timed_seconds / timed_tokens
        eta = max([queued / max(1, workers), *running_eta])
    rate = tokens_total / (seconds + eta) if eta is not None and seconds + eta > 0 else None
    prices = plan.spec.prices
    cost = None
    if prices.has_token_prices:
        cost = (
            computed * prices.input + cached * prices.cached_input + generated * prices.output
        ) / 1e6
    return Snapshot(
        rows_done=rows_done,
        rows_total=sum(s.num_rows for s in pending),
        tokens_done=tokens_done,
        tokens_total=tokens_total,
        seconds=seconds,
        tokens_per_s=rate,
        eta_s=eta,
        cost=cost,
    )


def read_records(plan: JobPlan) -> dict[str, dict]:
    """The job's progress records (none when they cannot be read now)."""
    try:
        return out.read_progress(plan.spec.output, plan.spec.storage_options)
    except Exception as exc:
        # A store that is down for a while fails this read with its client's own error
        # (botocore's are not OSErrors): the flow goes on waiting for its shards, which
        # retry or fail by themselves, rather than failing here without them.
        if isinstance(exc, OSError) or is_store_error(exc):
            return {}
        raise
