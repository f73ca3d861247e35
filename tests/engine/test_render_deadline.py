"""The chat template's time limit (`engine/loader/render_deadline.py`): a block past its
deadline is stopped in its own thread, and the stop never lands after the block."""

from __future__ import annotations

import threading
import time

import pytest

from tokenmill.engine.loader.render_deadline import deadline


class Stopped(Exception):
    pass


def spin(seconds: float) -> int:
    """Pure Python work for `seconds` (what an endless template loop runs)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def test_a_block_past_its_deadline_is_stopped():
    start = time.monotonic()
    with pytest.raises(Stopped), deadline(0.2, Stopped):
        spin(30)
    assert 0.2 <= time.monotonic() - start < 3


def test_a_block_in_another_thread_is_stopped_there():
    raised: list[str] = []

    def render():
        try:
            with deadline(0.1, Stopped):
                spin(30)
        except Stopped:
            raised.append(threading.current_thread().name)

    thread = threading.Thread(target=render, name="renderer")
    thread.start()
    thread.join(10)
    assert raised == ["renderer"]


def test_a_stop_never_lands_after_the_block():
    # Blocks that end before, about at and after their deadline: a stop may end the
    # block, but none may be left pending for the code after it.
    stopped = 0
    for i in range(200):
        try:
            with deadline(0.005, Stopped):
                spin(0.005 * (i % 5))
        except Stopped:
            stopped += 1
        spin(0.003)  # raises here if a stop was left pending
    assert 0 < stopped < 200
