"""Attention backends, one module each, and the choice among them.

`BACKENDS` lists them in order of preference; `select_backend` gives the first that
serves a model's attention (`AttentionSpec`), and the runner keeps it for good.

How to add an attention backend
-------------------------------
Write one module here with a subclass of `backend.AttentionBackend`: its `name`, an
`unsupported(spec)` that says why it cannot serve a spec (devices, dtypes, KV cache
dtypes, head sizes, block sizes) or None, and a `build(step, out)` that turns a step's
flattened tokens into a `StepAttention` whose `attend` writes the keys and values into
the cache and attends. Then add the class to `BACKENDS` below, where its preference
falls. Models, the runner and the KV cache need no change (tests/engine/test_attention.py
runs every backend against transformers).
"""

from __future__ import annotations

from tokenmill.engine.worker.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    StepAttention,
    StepTokens,
)
from tokenmill.engine.worker.attention.native import NativeBackend
from tokenmill.engine.worker.attention.portable import PortableBackend
from tokenmill.engine.worker.attention.triton import TritonBackend

# In order of preference: the native CPU kernels, the Triton kernels on CUDA, then the
# portable PyTorch path, which serves every spec with a cache in the model's dtype.
BACKENDS: tuple[type[AttentionBackend], ...] = (NativeBackend, TritonBackend, PortableBackend)


def backend_named(name: str) -> type[AttentionBackend]:
    """The backend class called `name` (ValueError naming the choices)."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(
        f"unknown attention backend {name!r}; choose from {', '.join(b.name for b in BACKENDS)}"
    )


def select_backend(spec: AttentionSpec) -> AttentionBackend:
    """The first backend of `BACKENDS` that serves spec.

    Raises:
        ValueError: none does; the message gives each backend's reason.
    """
    reasons = []
    for backend in BACKENDS:
        reason = backend.unsupported(spec)
        if reason is None:
            return backend(spec)
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(
        f"no attention backend serves this model here (kv_cache_dtype "
        f"{spec.kv_cache_dtype!r}, {spec.dtype}, {spec.device}): " + "; ".join(reasons)
    )


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionSpec",
    "StepAttention",
    "StepTokens",
    "backend_named",
    "select_backend",
]
