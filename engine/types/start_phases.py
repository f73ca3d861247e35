"""Where a model's start goes: the wall seconds of each phase of `LLM(...)`, in order.

`LLM.start_phases` reads them (benchmarks/load_time.py prints them beside llama.cpp's
load). The phases, as LLM and worker/build.py record them:

    resolve    the model found (a .gguf converted to its directory on first use)
    tokenizer  tokenizer.json read and built
    checks     config, settings, the attention backend - which loads the native
               kernels, compiling them where the kernel cache has no build for this CPU
    plan       the memory plan (weights and KV cache against the RAM left)
    load       the checkpoint's tensors read into the model (mapped or copied)
    quantize   the mode's quantization: each layer swapped as the load fills it (timed
               apart from the load it interrupts) and what quantize_model does after
    pack       the float layers left (the lm_head) packed for oneDNN and checked, and
               a mixture of experts' experts packed
    kv_cache   the KV cache allocated
    runner     the model runner (rotary tables, attention metadata, sampler)
    engine     the engine loop (scheduler, block manager) around the runner - and for
               an encoder, whose load is not split, everything after the tokenizer
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StartPhases:
    """Seconds per phase (see the module docstring). `lap(name)` gives a phase the time
    since the previous lap, less what `phase` timed inside it, so a phase nested in
    another (quantizing inside the load) is counted once, under its own name."""

    seconds: dict[str, float] = field(default_factory=dict)
    _mark: float = field(init=False, repr=False)  # when the last lap ended
    _nested: float = field(default=0.0, init=False, repr=False)  # phase() since then

    def __post_init__(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._add(name, now - self._mark - self._nested)
        self._mark, self._nested = now, 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self._add(name, took)
            self._nested += took

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
