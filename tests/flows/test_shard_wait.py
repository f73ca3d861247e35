"""The flow's wait for its shards: progress publishing must never run inside a timeout
scope. Prefect's `as_completed(timeout=...)` arms a SIGALRM timer on the main thread (a
watcher thread off it) that stays armed while the caller's loop body runs; a slow
publish then gets a CancelledError (a BaseException) that ends the flow as Crashed.

Real Prefect futures (the thread runner's kind) around shards that end at staggered
times, and a publish slower than the publish interval; no server is needed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from prefect.futures import PrefectConcurrentFuture
from prefect.states import Completed, Failed

from tokenmill.flows import batch_flow

INTERVAL_S = 0.1


class SlowProgress:
    """A progress publisher that takes longer than the publish interval (as a socket
    `recv` to a slow API does), in short steps so an injected exception can land."""

    def __init__(self, seconds: float = 4 * INTERVAL_S):
        self.seconds, self.starts = seconds, []

    def publish(self) -> None:
        self.starts.append(time.monotonic())
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            time.sleep(0.005)


def shard_futures(pool: ThreadPoolExecutor, ends_s: list[float], fail: set[int] = frozenset()):
    def shard(i: int, after: float):
        time.sleep(after)
        return Failed(message="boom") if i in fail else Completed(data=f"run-{i}")

    return [
        PrefectConcurrentFuture(uuid.uuid4(), pool.submit(shard, i, after))
        for i, after in enumerate(ends_s)
    ]


@pytest.fixture
def short_interval(monkeypatch):
    monkeypatch.setattr(batch_flow, "PUBLISH_EVERY_S", INTERVAL_S)


def run_waits(progress, ends_s, fail=frozenset()):
    with ThreadPoolExecutor(max_workers=len(ends_s)) as pool:
        futures = shard_futures(pool, ends_s, fail)
        return batch_flow._shard_runs(SimpleNamespace(job_id="j1"), futures, progress)


def test_slow_publish_on_the_main_thread_does_not_crash_the_wait(short_interval):
    assert threading.current_thread() is threading.main_thread()
    progress, started = SlowProgress(), time.monotonic()
    runs = run_waits(progress, [0.05, 0.3, 0.6, 1.0])
    assert runs == ["run-0", "run-1", "run-2", "run-3"]
    # published again once the last shard had ended (before waiting: the test below)
    assert progress.starts[-1] - started >= 1.0


def test_slow_publish_off_the_main_thread_does_not_crash_the_wait(short_interval):
    progress, outcome, started = SlowProgress(), {}, time.monotonic()

    def target():
        try:
            outcome["runs"] = run_waits(progress, [0.05, 0.3, 0.6, 1.0])
        except BaseException as exc:  # noqa: BLE001 - the escape is what is tested
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "error" not in outcome, repr(outcome.get("error"))
    assert outcome["runs"] == ["run-0", "run-1", "run-2", "run-3"]
    assert progress.starts[-1] - started >= 1.0


def test_publishes_between_shards_while_nothing_ends(short_interval):
    class Counting:
        calls = 0
        first = None

        def publish(self):
            self.calls += 1
            self.first = self.first or time.monotonic()

    progress, started = Counting(), time.monotonic()
    assert run_waits(progress, [1.0]) == ["run-0"]
    # published before waiting: well before the only shard ends (slack for a loaded machine)
    assert progress.first - started < 0.5
    # ~1 s of waiting at a 0.1 s interval: several timed publishes, not just start and end
    assert progress.calls >= 5


def test_a_failed_shard_fails_the_wait_after_all_shards_end(short_interval):
    progress = SlowProgress(seconds=0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="1 of 3 shard tasks did not complete"):
        run_waits(progress, [0.05, 0.3, 0.5], fail={0})
    assert time.monotonic() - started >= 0.5  # the other shards were waited for


class CancelledShard:
    """A shard future as the Dask runner's looks once its client lost the scheduler: it
    has ended, and waiting on it raises the client's cancellation."""

    def add_done_callback(self, callback):
        callback(self)

    def wait(self):
        raise concurrent.futures.CancelledError(
            "shard_task-1c94 cancelled for reason: scheduler-connection-lost.\n"
            "Client lost the connection to the scheduler."
        )


def test_shards_cancelled_by_a_lost_scheduler_fail_the_wait_by_name(short_interval):
    progress = SlowProgress(seconds=0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [*shard_futures(pool, [0.05, 0.2]), CancelledShard()]
        with pytest.raises(RuntimeError) as raised:
            batch_flow._shard_runs(SimpleNamespace(job_id="j1"), futures, progress)
    message = str(raised.value)
    assert message.startswith("job j1: 1 of 3 shard tasks were cancelled by the task runner")
    assert "scheduler-connection-lost" in message and "run the flow again" in message
