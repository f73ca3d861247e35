"""One loaded engine per worker process, shared by every shard task that runs there.

Loading a model costs seconds (minutes for a large one on a GPU); a shard costs far
less. So the engine is loaded on a worker's first shard and reused by the rest, in
the flow's own process (thread-pool task runner) and in each Dask or Ray worker
process alike. One engine per process: a job that asks for a different model,
dtype, device or engine option replaces it, so a long-lived GPU worker never holds
two models at once.

The engine is not thread-safe, and a task runner may run shard tasks on several
threads of one process; `CachedEngine.lock` serializes their `generate` calls.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from tokenmill.pipelines.spec import JobSpec


@dataclass(frozen=True)
class EngineKey:
    """What makes two jobs able to share a loaded engine."""

    model: str | None
    dtype: str
    device: str | None
    engine_options: str  # canonical JSON of JobSpec.engine_options

    @classmethod
    def for_spec(cls, spec: JobSpec) -> EngineKey:
        options = json.dumps(spec.engine_options, sort_keys=True, default=str)
        return cls(spec.model, str(spec.dtype), spec.device, options)


@dataclass
class CachedEngine:
    """A loaded LLM, the weights hash of its files, and the lock its users share."""

    key: EngineKey
    llm: Any
    weights_hash: str
    pid: int
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


_lock = threading.Lock()
_current: CachedEngine | None = None
_num_loads = 0


def get_engine(spec: JobSpec) -> CachedEngine:
    """The process's engine for `spec`, loading it on first use.

    Args:
        spec: the job; its model, dtype, device and engine_options pick the engine.

    Returns:
        The CachedEngine (the same object for every call with an equal key).
    """
    global _current, _num_loads
    key = EngineKey.for_spec(spec)
    # Loading under the module lock: two threads asking at once load the model once.
    with _lock:
        if _current is not None and _current.key == key and _current.pid == os.getpid():
            return _current
        from tokenmill.engine.model_files import weights_hash
        from tokenmill.pipelines.job import load_llm

        _current = None  # drop the old engine before loading the next one
        llm = load_llm(spec)
        _current = CachedEngine(key, llm, weights_hash(llm.model_dir), os.getpid())
        _num_loads += 1
        return _current


def num_loads() -> int:
    """How many times this process has loaded an engine (for tests and task results)."""
    return _num_loads


def clear() -> None:
    """Forget the cached engine (its memory is freed once no task holds it)."""
    global _current
    with _lock:
        _current = None
