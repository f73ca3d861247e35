"""The engine's profiling hook: a `StepProfiler` is told about each stage of a step.

The loop and the runner wrap every stage of a step in `profiler.stage(name)` and pass
each step's attention metadata through `profiler.attention(meta)`; the default profiler
does nothing (one shared no-op context per stage: well under a microsecond a step). A
tool that wants the figures subclasses it and installs it with `LLM.set_profiler` -
`tokenmill.bench.profile.StageTimer` is one. The stages, in a step's order:

    schedule   the scheduler picks the step's chunks (the loop)
    prepare    the step's inputs, sampling batch (settings, bans, penalties, grammar
               masks) and attention metadata, built and uploaded (runner)
    forward    the model over the step's tokens, attention included (runner)
    images     inside forward, for a vision model: the step's decoded images made into
               the tower's input (normalised, patched; a decode not yet finished is
               waited for here)
    vision     inside forward: the vision tower (and projector) over the step's images
    logits     the lm_head where a token is sampled or a prompt scored (runner)
    pool       an encoder batch's pooling and classification head (encoder runner)
    sample     the sampler (runner)
    resolve    sampled tokens become sequence updates and finished requests (the loop)

Linear layers are timed with torch's own module hooks (`register_forward_pre_hook`),
which need nothing from the engine but the model: `set_profiler` hands it to the
profiler's `watch`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

STAGES = (
    "schedule", "prepare", "forward", "images", "vision", "logits", "pool", "sample", "resolve"
)  # fmt: skip
_NOTHING = nullcontext()


class StepProfiler:
    """Does nothing; subclass it to record (see the module docstring)."""

    def stage(self, name: str) -> AbstractContextManager:
        """A context around one stage of a step; `name` is one of STAGES."""
        return _NOTHING

    def watch(self, model: Any) -> None:
        """Called by `LLM.set_profiler` with the model (an `nn.Module`) whose steps this
        profiler will see, and with None when another profiler replaces it; a profiler
        may hook the model's modules here and must remove its hooks on None."""

    def attention(self, meta: Any) -> Any:
        """The step's attention metadata, as the model will see it (the same object by
        default; a profiler may return a wrapper whose `attend` it times)."""
        return meta


NO_PROFILER = StepProfiler()
