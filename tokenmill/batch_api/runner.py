"""Running batches: one thread that takes queued batches in, runs them and finishes them.

    validating   queued; validated (`validation.py`) and planned when it is taken in
    in_progress  its job's shards run; request_counts and usage grow as shards publish
    finalizing   the job is finalized (`finalize_job`: ledger), output and error files cut
    completed    - or, stopped on the way: cancelling -> cancelled, or expired, both
                 keeping what finished (the rest are error lines), or failed (`errors`)

Fairness. At most `max_concurrent_batches` batches are in progress, at most one per key:
a key's batches run one after another in creation order, and batches of different keys
run together, their shards taken in turn - so one key's 50,000-line batch never starves
another's, which waits at most for the shard that is running.

Durability. A batch's record is its row in the database and its job's output directory
on the store. A server killed at any moment and started again takes in the batches that
were in progress first (in creation order), plans their jobs again and skips the shards
already published - the job runner's own resume (`pipelines/running.py`) - so every
custom_id is answered exactly once. A store that fails (an outage) leaves the batch
where it was: the runner tries it again later, and it resumes.

Two runners share this loop: `LocalRunner` here runs shards in this process with one warm
engine per model; `PrefectRunner` (`prefect_runner.py`) makes each batch a flow run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.batch_api.database import now
from tokenmill.batch_api.jobs import (
    CANCELLED,
    EXPIRED,
    ServerState,
    job_spec,
    publish_outputs,
    publish_unstarted,
    stop_pending,
    usage_of,
)
from tokenmill.batch_api.validation import validate_input
from tokenmill.connectors.store_retries import is_store_error
from tokenmill.engine import LLM
from tokenmill.pipelines.engine_failures import ShardInterrupted
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.ledger import now_iso
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, plan_job
from tokenmill.pipelines.running import prepare_output, run_shard
from tokenmill.pipelines.shared_llm import call_key

log = logging.getLogger(__name__)

QUEUED, RUNNING, FINALIZING, CANCELLING = "validating", "in_progress", "finalizing", "cancelling"
OPEN = (QUEUED, RUNNING, FINALIZING, CANCELLING)
# After a store failure, a batch waits this long (doubling, up to the cap) to be tried again.
RETRY_AFTER_S, RETRY_AFTER_MAX_S = 2.0, 60.0
RETENTION_EVERY_S = 300.0


@dataclass
class Active:
    """A batch taken in: its job's plan, the shards left, and what holds its output."""

    batch: dict[str, Any]
    plan: JobPlan | None = None
    pending: deque[Shard] = field(default_factory=deque)
    llm: Any = None
    hold: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    stop_reason: tuple[str, str] | None = None  # CANCELLED or EXPIRED
    started_at: str = field(default_factory=now_iso)
    num_shards_run: int = 0
    flow_run_id: str | None = None  # PrefectRunner

    @property
    def id(self) -> str:
        return self.batch["id"]

    @property
    def owner(self) -> str:
        return self.batch["owner"]


class StoreOutage(RuntimeError):
    """The store failed under a batch's work: it is tried again later."""


def store_failed(exc: BaseException) -> bool:
    """Whether the store failed under a batch's work (it is tried again later)."""
    return isinstance(exc, (OSError, StoreOutage)) or is_store_error(exc)


class Runner:
    """The loop (see the module docstring); subclasses say how a batch's job runs."""

    holds_output = True  # the runner holds each job's output lock (not a flow run)

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.active: dict[str, Active] = {}
        self._turn: deque[str] = deque()  # owners, in the order their shards are taken
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stop_requests: set[str] = set()
        self._retry_at: dict[str, tuple[float, float]] = {}  # batch id -> (when, wait)
        # The output locks of batches put off by a store outage, kept until they are
        # taken in again: a lock that could not be released in the outage would be
        # this live process's, and refuse its own retake.
        self._kept_holds: dict[str, contextlib.ExitStack] = {}
        self._swept_at = 0.0
        self._thread: threading.Thread | None = None

    # -- the API's side ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batch-runner", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for active in list(self.active.values()):
            active.hold.close()
        for hold in self._kept_holds.values():
            hold.close()

    def wake(self) -> None:
        """Something changed (a batch was created or cancelled): look now."""
        self._wake.set()

    def request_stop(self, batch_id: str) -> None:
        """Stop the batch's running shard now (it was cancelled)."""
        self._stop_requests.add(batch_id)
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                worked = self.step()
            except Exception:  # the loop must outlive any one batch's trouble
                log.exception("the batch runner's step failed; going on")
                worked = False
            if not worked:
                self._wake.wait(self.state.settings.poll_s)
                self._wake.clear()

    def step(self) -> bool:
        """One round: retention, stops, admissions, then one unit of work. Whether there
        was work (if not, the loop waits to be woken)."""
        self._sweep_retention()
        self._note_stops()
        self._admit()
        return self._advance()

    def _note_stops(self) -> None:
        at = time.time()
        for batch in self.state.db.batches_in((QUEUED, RUNNING, CANCELLING)):
            reason = None
            if batch["status"] == CANCELLING:
                reason = CANCELLED
            elif batch["expires_at"] is not None and batch["expires_at"] <= at:
                reason = EXPIRED
            if reason is None:
                continue
            active = self.active.get(batch["id"])
            if active is not None:
                active.stop_reason = active.stop_reason or reason
            elif batch["in_progress_at"] is None:
                self._guard(batch, lambda b=batch, r=reason: self._finish_unstarted(b, r))

    def _admit(self) -> None:
        """Take in batches: first those a killed server had in progress, then queued
        ones in creation order - one per key, up to the limit."""
        limit = self.state.settings.max_concurrent_batches
        candidates = self.state.db.batches_in((RUNNING, FINALIZING, CANCELLING, QUEUED))
        busy = {a.owner for a in self.active.values()}
        for batch in sorted(candidates, key=lambda b: (b["status"] == QUEUED, b["seq"])):
            if len(self.active) >= limit:
                return
            if batch["id"] in self.active or batch["owner"] in busy or self._waiting(batch):
                continue
            if batch["status"] == CANCELLING and batch["in_progress_at"] is None:
                continue  # answered by _note_stops
            if self._guard(batch, lambda b=batch: self._take_in(b)):
                busy.add(batch["owner"])

    def _take_in(self, batch: dict[str, Any]) -> None:
        db, settings = self.state.db, self.state.settings
        if batch["in_progress_at"] is None:
            found = validate_input(
                self.state.store,
                batch["input_file_id"],
                batch["endpoint"],
                self.state.models,
                max_lines=settings.max_lines,
                max_embedding_inputs=settings.max_embedding_inputs,
            )
            if found.errors:
                db.transition(
                    batch["id"],
                    (QUEUED,),
                    status="failed",
                    failed_at=now(),
                    errors=found.listed(),
                    total=found.num_lines,
                )
                return
            db.update_batch(batch["id"], model=found.model, total=found.num_lines)
            batch = db.batch_by_id(batch["id"])
        active = Active(batch)
        kept = self._kept_holds.pop(batch["id"], None)
        if kept is not None:
            active.hold = kept
        try:
            spec = job_spec(self.state, batch)
            if self.holds_output and kept is None:
                active.hold.enter_context(claimed_output(spec.output, spec.storage_options))
            self.start_job(active, spec)
        except ValueError as exc:  # the file or its options cannot make a job
            active.hold.close()
            db.transition(
                batch["id"],
                (QUEUED, RUNNING, CANCELLING),
                status="failed",
                failed_at=now(),
                errors=[{"code": "invalid_file", "message": str(exc), "line": None}],
            )
            return
        except Exception as exc:
            if store_failed(exc):  # put off: the lock is kept for the retake
                self._kept_holds[batch["id"]] = active.hold
            else:
                active.hold.close()
            raise
        if batch["status"] == QUEUED:
            if not db.transition(batch["id"], (QUEUED,), status=RUNNING, in_progress_at=now()):
                active.stop_reason = CANCELLED  # cancelled while it was being planned
        elif batch["status"] == CANCELLING:
            active.stop_reason = CANCELLED
        active.batch = db.batch_by_id(batch["id"])
        self.active[active.id] = active
        if active.owner not in self._turn:
            self._turn.append(active.owner)

    def _advance(self) -> bool:
        """One unit of work for the next key in turn; whether there was any."""
        for _ in range(len(self._turn)):
            owner = self._turn[0]
            self._turn.rotate(-1)
            active = next((a for a in self.active.values() if a.owner == owner), None)
            if active is None:
                self._turn.remove(owner)
                continue
            if self._waiting(active.batch):
                continue
            did: list[bool | None] = []
            self._guard(active.batch, lambda a=active, d=did: d.append(self.work_on(a)))
            return did != [False]
        return False

    def _guard(self, batch: dict[str, Any], work) -> bool:
        """Run `work` for a batch; a store failure puts the batch off for a while (it
        resumes later), anything else fails it with the error's message."""
        try:
            work()
        except Exception as exc:
            if store_failed(exc):
                self._put_off(batch, exc)
                return False
            log.exception("batch %s failed", batch["id"])
            self._fail(batch, f"{type(exc).__name__}: {exc}")
            return False
        self._retry_at.pop(batch["id"], None)
        return True

    def _put_off(self, batch: dict[str, Any], exc: BaseException) -> None:
        _, wait = self._retry_at.get(batch["id"], (0.0, RETRY_AFTER_S / 2))
        wait = min(wait * 2, RETRY_AFTER_MAX_S)
        self._retry_at[batch["id"]] = (time.time() + wait, wait)
        log.warning(
            "batch %s: the store failed (%s); trying again in %.0f s",
            batch["id"],
            type(exc).__name__,
            wait,
        )
        active = self.active.pop(batch["id"], None)
        if active is not None:  # taken in again (planned anew) once the store is back
            self._kept_holds[active.id] = active.hold
            self.drop_job(active)

    def _waiting(self, batch: dict[str, Any]) -> bool:
        when, _ = self._retry_at.get(batch["id"], (0.0, 0.0))
        return time.time() < when

    def _fail(self, batch: dict[str, Any], message: str) -> None:
        active = self.active.pop(batch["id"], None)
        if active is not None:
            active.hold.close()
        kept = self._kept_holds.pop(batch["id"], None)
        if kept is not None:
            kept.close()
        self.state.db.transition(
            batch["id"],
            OPEN,
            status="failed",
            failed_at=now(),
            errors=[{"code": "batch_failed", "message": message, "line": None}],
        )

    # -- finishing ---------------------------------------------------------------------

    def finish(self, active: Active, ledger: Any) -> None:
        """The job is finalized: cut its output and error files, and close the batch."""
        outcome = publish_outputs(self.state, active.batch)
        reason = active.stop_reason
        status = (
            "completed" if reason is None else "cancelled" if reason == CANCELLED else "expired"
        )
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
        self.state.db.update_batch(
            active.id,
            status=status,
            **{stamp[status]: now()},
            output_file_id=outcome.output_file_id,
            error_file_id=outcome.error_file_id,
            completed=outcome.completed,
            failed=outcome.failed,
            total=outcome.completed + outcome.failed,
            **usage_of(ledger),
        )
        self.active.pop(active.id, None)
        self._stop_requests.discard(active.id)
        active.hold.close()
        self.drop_job(active)
        log.info("batch %s %s: %d ok, %d failed", active.id, status, *_counts(outcome))

    def _finish_unstarted(self, batch: dict[str, Any], reason: tuple[str, str]) -> None:
        outcome = publish_unstarted(self.state, batch, reason)
        status, stamp = (
            ("cancelled", "cancelled_at") if reason == CANCELLED else ("expired", "expired_at")
        )
        self.state.db.transition(
            batch["id"],
            (QUEUED, CANCELLING),
            status=status,
            **{stamp: now()},
            error_file_id=outcome.error_file_id,
            failed=outcome.failed,
            total=outcome.failed,
        )

    def _sweep_retention(self) -> None:
        """Delete files past their expiry, and the work of batches past retention."""
        if time.time() - self._swept_at < RETENTION_EVERY_S:
            return
        self._swept_at = time.time()
        db, store = self.state.db, self.state.store
        for row in db.expired_files(now()):
            store.remove_file(row["id"])
            db.remove_file(row["owner"], row["id"])
        cutoff = now() - int(self.state.settings.retention_s)
        for batch in db.finished_batches_before(cutoff):
            if batch["status"] not in OPEN:
                store.remove_batch_work(batch["id"])
                db.update_batch(batch["id"], work_removed=1)

    # -- what a runner does ------------------------------------------------------------

    def start_job(self, active: Active, spec: Any) -> None:
        """Plan the batch's job (or attach to its run), holding its output."""
        raise NotImplementedError

    def work_on(self, active: Active) -> bool | None:
        """One unit of the batch's work: a shard, a look at its run, or its end (False:
        there was nothing to do but look)."""
        raise NotImplementedError

    def drop_job(self, active: Active) -> None:
        """Forget what the runner holds for the batch (it finished or was put off)."""

    def should_stop(self, active: Active) -> bool:
        """Whether the batch's running work must stop now."""
        expires_at = active.batch["expires_at"]
        if expires_at is not None and expires_at <= time.time():
            active.stop_reason = active.stop_reason or EXPIRED
        if active.id in self._stop_requests:
            active.stop_reason = active.stop_reason or CANCELLED
        return self._stopping.is_set() or active.stop_reason is not None


class LocalRunner(Runner):
    """Runs each batch's shards in this process, one warm engine per model."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self._engines: dict[tuple, Any] = {}

    def engine(self, llm_options: dict[str, Any]) -> Any:
        key = call_key(LLM, **llm_options)
        if key not in self._engines:
            self._engines[key] = LLM(**llm_options)
        return self._engines[key]

    def start_job(self, active: Active, spec: Any) -> None:
        active.llm = self.engine(spec.llm_options)
        active.plan = plan_job(spec, llm=active.llm)
        done = prepare_output(active.plan)
        active.pending = deque(s for s in active.plan.shards if s.shard_id not in done)

    def work_on(self, active: Active) -> None:
        if self.should_stop(active) and not self._stopping.is_set():
            self._stop(active)
            return
        if not active.pending:
            self._finalize(active)
            return
        shard = active.pending[0]

        def check(_stats: Any) -> None:
            if self.should_stop(active):
                raise ShardInterrupted(active.id)

        try:
            result = run_shard(active.llm, active.plan, shard, on_step=check)
        except ShardInterrupted:
            return  # the stop is handled on the batch's next turn
        active.pending.popleft()
        if result.skipped:
            return
        active.num_shards_run += 1
        batch = self.state.db.batch_by_id(active.id)
        self.state.db.update_batch(
            active.id,
            completed=batch["completed"] + result.num_rows - result.rows_failed,
            failed=batch["failed"] + result.rows_failed,
            input_tokens=batch["input_tokens"] + result.prompt_tokens,
            cached_tokens=batch["cached_tokens"] + result.cached_tokens,
            output_tokens=batch["output_tokens"] + result.completion_tokens,
            reasoning_tokens=batch["reasoning_tokens"] + result.reasoning_tokens,
        )

    def _stop(self, active: Active) -> None:
        stop_pending(active.llm, active.plan, reason=active.stop_reason)
        active.pending.clear()
        self._finalize(active)

    def _finalize(self, active: Active) -> None:
        if active.stop_reason is None:
            self.state.db.transition(active.id, (RUNNING,), status=FINALIZING, finalizing_at=now())
        ledger = finalize_job(
            active.plan, run_started_at=active.started_at, num_shards_run=active.num_shards_run
        )
        self.finish(active, ledger)


def _counts(outcome: Any) -> tuple[int, int]:
    return outcome.completed, outcome.failed
