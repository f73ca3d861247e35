"""Where an engine's time goes: a `StepProfiler` that times each stage of each step.

Installed with `LLM.set_profiler` (engine/types/profiling.py names the stages), it adds the
linear layers and attention as stages of their own - linear layers through torch's
module hooks, attention through the metadata the runner hands it - and subtracts a
stage's time from the stage it runs inside, so the stages add up to the time spent in
steps. On the CPU every op is synchronous, so time inside a stage is that stage's cost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from torch import nn

from tokenmill.engine import StepProfiler, linear_kinds

LINEAR = "linear layers"
LM_HEAD = "lm_head"
ATTENTION = "attention"


class StageTimer(StepProfiler):
    """Accumulates exclusive wall time and calls per stage.

    Args:
        linear_layers: also time the model's linear layers (and the lm_head) as stages of
            their own, hooked when the timer is installed; off, the timer adds nothing to
            a linear call.
    """

    def __init__(self, *, linear_layers: bool = False) -> None:
        self.linear_layers = linear_layers
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [stage, start, time spent in nested stages]
        self._hooks: list[Any] = []

    def enter(self, stage: str) -> None:
        self._stack.append([stage, time.perf_counter(), 0.0])

    def exit(self) -> None:
        stage, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[stage] += elapsed - nested
        self.calls[stage] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextmanager
    def stage(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def attention(self, meta: Any) -> Any:
        return _TimedAttention(meta, self)

    def watch(self, model: nn.Module | None) -> None:
        """Time every linear module of `model` (float, packed or quantized) as a stage,
        the lm_head apart, when the timer was asked to (installed twice, hooked once;
        None, when replaced: no hooks left)."""
        self.remove_hooks()
        if model is None or not self.linear_layers:
            return
        lm_head = getattr(model, "lm_head", None)
        for module in model.modules():
            if isinstance(module, linear_kinds()):
                name = LM_HEAD if module is lm_head else LINEAR
                self._hooks.append(module.register_forward_pre_hook(self._pre(name)))
                self._hooks.append(module.register_forward_hook(self._post))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def _pre(self, name: str):
        def enter(*_: Any) -> None:
            self.enter(name)

        return enter

    def _post(self, *_: Any) -> None:
        self.exit()


# The clocks ThreadSplitTimer reads: wall time, the CPU time of every thread of the
# process, and the CPU time of the thread that runs the step (the one calling the timer).
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "main": time.thread_time,
}


class ThreadSplitTimer(StageTimer):
    """A StageTimer that times each stage on several clocks at once (`by_clock[clock]
    [stage]`, exclusive seconds as `seconds`, which holds the "cpu" clock's).

    With torch's threads waiting passively (OMP_WAIT_POLICY=PASSIVE: a thread with no work
    sleeps rather than spins, so a spin is not counted as work), a stage's "main" CPU
    beyond its "cpu" / threads is the time the step's thread worked while the others
    waited: Python, torch ops that do not split, uneven splits. Unlike wall time, this
    holds on a busy machine. Another thread's CPU reaches the process's count up to a
    scheduler tick late, so a stage shorter than a few milliseconds may be charged some
    of its neighbour's.
    """

    def __init__(
        self, *, linear_layers: bool = False, clocks: dict[str, Callable[[], float]] = CLOCKS
    ) -> None:
        super().__init__(linear_layers=linear_layers)
        self.clocks = clocks
        self.by_clock: dict[str, dict[str, float]] = {c: defaultdict(float) for c in clocks}
        self.seconds = self.by_clock["cpu"]

    def enter(self, stage: str) -> None:
        now = [clock() for clock in self.clocks.values()]
        self._stack.append([stage, now, [0.0] * len(now)])

    def exit(self) -> None:
        stage, start, nested = self._stack.pop()
        now = [clock() for clock in self.clocks.values()]
        for i, clock in enumerate(self.clocks):
            elapsed = now[i] - start[i]
            self.by_clock[clock][stage] += elapsed - nested[i]
            if self._stack:
                self._stack[-1][2][i] += elapsed
        self.calls[stage] += 1

    def split(self) -> dict[str, dict[str, float]]:
        """A copy of every clock's stage seconds."""
        return {clock: dict(stages) for clock, stages in self.by_clock.items()}

    def reset(self) -> None:
        for stages in self.by_clock.values():
            stages.clear()
        self.calls.clear()


class _TimedAttention:
    """A step's attention metadata whose `attend` is timed as the attention stage."""

    def __init__(self, meta: Any, timer: StageTimer) -> None:
        self._meta = meta
        self._timer = timer

    def attend(self, *args: Any, **kwargs: Any):
        self._timer.enter(ATTENTION)
        try:
            return self._meta.attend(*args, **kwargs)
        finally:
            self._timer.exit()


def profile_llm(llm: Any) -> StageTimer:
    """A StageTimer installed on `llm`, its linear layers hooked."""
    timer = StageTimer(linear_layers=True)
    llm.set_profiler(timer)
    return timer
