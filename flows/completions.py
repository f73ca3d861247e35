"""Waiting for a flow's shard futures without a timeout scope.

The flow publishes progress while it waits for its shards: whenever one ends, and at
least every few seconds. Prefect's `as_completed(timeout=...)` and `wait(timeout=...)`
enforce their timeout with a cancel scope - SIGALRM on the main thread, a watcher
thread that injects an exception off it - and `as_completed` yields from inside that
scope, so the caller's loop body runs with the timer armed. When it fires there, a
`CancelledError` (a BaseException, past every `except Exception`) ends the flow as
Crashed. Here the wait is a queue fed by the futures' done callbacks, read with a
plain blocking timeout: no signal, no injected exception, and whatever the caller does
between waits runs outside any scope.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from typing import Any


class Completions:
    """Futures as they end, in batches, each wait bounded by a timeout.

    Args:
        futures: Prefect futures (any task runner's: each has `add_done_callback`).
    """

    def __init__(self, futures: Iterable[Any]) -> None:
        self._ended: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list[Any] = list(futures)
        # A callback runs on the task runner's thread (Dask's event loop, the thread
        # pool's worker) and only hands the future over; an ended future calls at once.
        for future in self.pending:
            future.add_done_callback(self._ended.put)

    def wait(self, timeout: float) -> list[Any]:
        """The futures that ended since the last wait, waiting up to `timeout` seconds
        for the first one; empty when none ended in time."""
        if not self.pending:
            return []
        try:
            ended = [self._ended.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                ended.append(self._ended.get_nowait())
            except queue.Empty:
                break
        ended_ids = {id(f) for f in ended}
        self.pending = [f for f in self.pending if id(f) not in ended_ids]
        return ended
