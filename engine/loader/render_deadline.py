"""Stops a thread's Python code at a deadline: the time limit of chat templates' renders.

A render is untrusted code (`chat_sandbox.py`). A trace hook (`sys.settrace`) can stop it,
but it calls back into Python on every frame and line the render runs, which made a
one-message render about three times slower: planning renders every row of a job. Here
one watchdog thread holds the deadlines of the renders under way and, past one, raises
the render's exception in the render's thread (CPython's `PyThreadState_SetAsyncExc`,
delivered between two bytecodes of that thread). A render itself only registers and
unregisters under a lock.

The exception is sent once. A render that ends while it is still pending clears it, so
it never lands in the code after the render; one that lands in the unregistering step
propagates from the render, which did overrun. Like the trace hook, a single long C call
is not interrupted: the size limits keep those short.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Without argtypes, ctypes passes None as NULL: PyThreadState_SetAsyncExc(id, NULL)
# clears a thread's pending exception.
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


@dataclass(eq=False)
class _Watch:
    thread_id: int
    deadline: float
    exception: type[BaseException]
    fired: bool = False


class _Watchdog:
    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._watches: set[_Watch] = set()
        self._thread: threading.Thread | None = None

    def start(self, seconds: float, exception: type[BaseException]) -> _Watch:
        watch = _Watch(threading.get_ident(), time.monotonic() + seconds, exception)
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="render-deadline", daemon=True
                )
                self._thread.start()
            self._watches.add(watch)
            self._changed.notify()
        return watch

    def end(self, watch: _Watch) -> None:
        with self._changed:
            self._watches.discard(watch)
            if watch.fired:  # not raised yet, or raised already: either way none is left
                _set_async_exc(ctypes.c_ulong(watch.thread_id), None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for watch in [w for w in self._watches if w.deadline <= now]:
                    self._watches.discard(watch)
                    watch.fired = True
                    _set_async_exc(
                        ctypes.c_ulong(watch.thread_id), ctypes.py_object(watch.exception)
                    )
                next_deadline = min((w.deadline for w in self._watches), default=None)
                self._changed.wait(None if next_deadline is None else next_deadline - now)


_WATCHDOG = _Watchdog()
# A forked child has no watchdog thread and may have copied a held lock.
os.register_at_fork(after_in_child=_WATCHDOG.__init__)


@contextmanager
def deadline(seconds: float, exception: type[BaseException]) -> Iterator[None]:
    """Raise `exception` (a class, built without arguments) in this thread if the block
    runs past `seconds`."""
    watch = _WATCHDOG.start(seconds, exception)
    try:
        yield
    finally:
        _WATCHDOG.end(watch)
