"""One loaded LLM per process, shared by every job, notebook call and flow task in it.

Loading a model costs seconds (minutes for a large one on a GPU); answering a batch
often costs less. So the first caller loads the engine and later callers that ask for
the same one reuse it: `run_job`, `tokenmill.generate` and the flow's shard tasks
alike, in the main process and in each Dask or Ray worker process.

- One engine at a time: asking for another model, dtype, device or engine option
  replaces it, so a long-lived GPU worker never holds two models: the old engine is
  dropped and its memory collected (and the CUDA cache emptied) before the next loads.
- It lives as long as the process: on a long-lived Dask cluster each worker keeps its
  engine warm across shards and across flow runs with the same model and settings.
- The key is every argument of `LLM(...)`, defaults filled in, so an argument `LLM`
  gains later (a revision, a quantization) takes part without a change here; dicts
  and lists among the values are compared by content.
- A forked worker inherits its parent's entry but not the parent's threads or device
  context: an entry remembers the pid that loaded it and is loaded again elsewhere.
- The engine is not thread-safe, and a task runner may run tasks on several threads
  of one process: callers hold `SharedLLM.lock` around `generate`.
- `preload` loads ahead of the callers, from a thread of its own (a Dask worker loads
  its engine while the flow plans); the first caller to ask for that engine waits for
  the load if it is still going, and is told it loaded it (so a shard task still
  reports its worker's one load and its seconds).
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tokenmill import faults
from tokenmill.engine import LLM

log = logging.getLogger(__name__)


@dataclass
class SharedLLM:
    """The process's loaded LLM and the lock its users share."""

    llm: LLM
    key: tuple
    pid: int  # the process that loaded it
    load_seconds: float = 0.0  # wall seconds `LLM(...)` took to load it
    load_started_at: float = 0.0  # time.time() when the load began
    # False while an engine `preload` loaded waits for its first caller, who is told
    # the load was for it.
    claimed: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @cached_property
    def weights_hash(self) -> str:
        """sha256 of the weight files loaded (the hash planning recorded for them)."""
        from tokenmill.engine import weights_hash

        return weights_hash(self.llm.model_dir)


_lock = threading.Lock()
_current: SharedLLM | None = None
_num_loads = 0


def get_llm(model: str | os.PathLike | None = None, **options: Any) -> SharedLLM:
    """The process's LLM for these arguments, loaded on first use.

    Args:
        model: as for `LLM(model)`.
        **options: any other `LLM(...)` keyword (dtype, device, kv_cache_memory, ...).

    Returns:
        The SharedLLM: the same object for every call with equal arguments, until a
        call with other arguments replaces it.

    Raises:
        TypeError: an option `LLM` does not take.
    """
    return acquire_llm(model, **options)[0]


def acquire_llm(model: str | os.PathLike | None = None, **options: Any) -> tuple[SharedLLM, bool]:
    """`get_llm`, and whether the engine was loaded for this very call (False: it was
    warm). An engine that `preload` loaded counts as loaded for its first caller."""
    return _acquire(model, options, claim=True)


def preload(model: str | os.PathLike | None = None, **options: Any) -> None:
    """Load the engine for these arguments ahead of its callers, from a thread of its
    own while the process does other work (a Dask worker while the flow plans); the
    first `acquire_llm` for it is told it loaded it. Nothing happens when that engine is
    already loaded; a load that fails is logged, and the next `acquire_llm` loads again
    and raises."""
    try:
        _acquire(model, options, claim=False)
    except Exception as exc:  # the caller that needs the engine meets the error
        log.warning("loading the engine ahead failed (it loads again when needed): %s", exc)


def _acquire(model: Any, options: dict[str, Any], *, claim: bool) -> tuple[SharedLLM, bool]:
    global _current, _num_loads
    key = call_key(LLM, model, **options)
    # Loading under the module lock: two threads asking at once load the model once.
    with _lock:
        if _current is not None and _current.key == key and _current.pid == os.getpid():
            first_claim = claim and not _current.claimed
            _current.claimed = _current.claimed or claim
            return _current, first_claim
        if _current is not None:
            _current = None  # drop the old engine before loading the next one
            _release_memory()
        started_at, started = time.time(), time.perf_counter()
        llm = _with_step_fault(LLM(model, **options))
        _current = SharedLLM(
            llm,
            key,
            os.getpid(),
            load_seconds=time.perf_counter() - started,
            load_started_at=started_at,
            claimed=claim,
        )
        _num_loads += 1
        return _current, True


def _release_memory() -> None:
    """Free a dropped engine's memory now, not at the garbage collector's leisure: its
    weights and KV cache would otherwise sit beside the next model's."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _with_step_fault(llm: LLM) -> LLM:
    """Put the `engine_step` fault point before each of the engine's steps when a test
    arms it: a job killed or failing mid-step is what the fault tests need, and the
    engine itself imports nothing of the fault module."""
    if faults.is_armed("engine_step"):
        step = llm.engine.step

        def step_with_fault():
            faults.fault_point("engine_step")
            return step()

        llm.engine.step = step_with_fault
    return llm


def call_key(function: Callable, *args: Any, **kwargs: Any) -> tuple:
    """A hashable key of a call's arguments, equal for calls that mean the same.

    Arguments are bound to `function`'s signature with defaults filled in (so leaving
    out a default and passing it are one key); mappings, lists and sets are compared by
    content, whatever their order of insertion.

    Raises:
        TypeError: the arguments do not fit the signature.
    """
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple((name, _frozen(value)) for name, value in bound.arguments.items())


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_frozen(v)) for v in value)))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def num_loads() -> int:
    """How many times this process has loaded an engine (for task results and tests)."""
    return _num_loads


def clear() -> None:
    """Forget the shared engine (its memory is freed once no caller holds it)."""
    global _current
    with _lock:
        _current = None
