"""Named fault points for fault-injection tests; inert unless TOKENMILL_FAULT_POINT is set.

A fault point is a call `fault_point("name", detail)` at a place where a real job can
die: planning a window, an engine step, an atomic file write. Tests (tests/faults/,
tests/faults/fault_matrix.py) set, in the job's environment,

    TOKENMILL_FAULT_POINT=NAME[@SUBSTRING]:COUNT[+][:ACTION]

and the COUNT-th call of NAME whose detail contains SUBSTRING triggers ACTION once
(with `+`: that call and every later one, as a broken device would):
`kill` (default: SIGKILL this process, as the OOM killer or a preempted node would)
`raise` (a `FaultInjected` error, as a failing engine step would) or `stall`
(sleep TOKENMILL_FAULT_STALL_S seconds, default 5: a hung disk or device). Examples:
`plan_window:2`, `write@/results/:3`, `write@ledger.json:1`, `engine_step:5:raise`.

This module imports nothing of tokenmill, so every layer (connectors, engine,
pipelines) may call it; when the variable is unset a call costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV_VAR = "TOKENMILL_FAULT_POINT"
STALL_ENV_VAR = "TOKENMILL_FAULT_STALL_S"
ACTIONS = ("kill", "raise", "stall")


class FaultInjected(RuntimeError):
    """The error a `raise` fault point throws."""


@dataclass(frozen=True)
class FaultSpec:
    """One armed fault point, parsed from TOKENMILL_FAULT_POINT."""

    name: str
    substring: str
    count: int
    action: str
    repeat: bool = False  # COUNT+: every call from the COUNT-th on

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse `NAME[@SUBSTRING]:COUNT[+][:ACTION]` (ValueError when malformed)."""
        head, sep, rest = text.partition(":")
        count_text, _, action = rest.partition(":")
        name, _, substring = head.partition("@")
        action = action or "kill"
        repeat = count_text.endswith("+")
        count_text = count_text.removesuffix("+")
        if not sep or not name or not count_text.isdigit() or int(count_text) < 1:
            raise ValueError(f"{ENV_VAR} must be NAME[@SUBSTRING]:COUNT[+][:ACTION], got {text!r}")
        if action not in ACTIONS:
            raise ValueError(f"{ENV_VAR}: action must be one of {ACTIONS}, got {action!r}")
        return cls(name, substring, int(count_text), action, repeat)


_hits: dict[str, int] = {}
_armed: list[FaultSpec | None] = []  # parsed once per process; [] = not parsed yet


def _spec() -> FaultSpec | None:
    if not _armed:
        text = os.environ.get(ENV_VAR)
        _armed.append(FaultSpec.parse(text) if text else None)
    return _armed[0]


def fault_point(name: str, detail: str = "") -> None:
    """Trigger the armed fault if this is its COUNT-th matching call; else do nothing.

    Args:
        name: the point's name (`plan_window`, `engine_step`, `write`, ...).
        detail: what the point is doing (e.g. the path being written), matched
            against the spec's SUBSTRING.

    Raises:
        FaultInjected: the armed action is `raise`.
    """
    spec = _spec()
    if spec is None or spec.name != name or spec.substring not in detail:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] < spec.count or (_hits[name] > spec.count and not spec.repeat):
        return
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.action == "stall":
        time.sleep(float(os.environ.get(STALL_ENV_VAR, "5")))
        return
    raise FaultInjected(f"injected fault at {name} (call {spec.count})")


def is_armed(name: str) -> bool:
    """Whether TOKENMILL_FAULT_POINT names the point `name` (so a caller can put a point
    around code that must not call this module itself, such as the engine's step)."""
    spec = _spec()
    return spec is not None and spec.name == name


def reset() -> None:
    """Forget the parsed spec and the hit counts (tests that change the variable)."""
    _hits.clear()
    _armed.clear()
