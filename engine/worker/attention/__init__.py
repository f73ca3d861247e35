"""Attention backends, one module each, and the choice among them.

`BACKENDS` lists them in order of preference; `select_backend` gives the first that
serves a model's attention (`AttentionSpec`), and the runner keeps it for good.

How to add an attention backend
-------------------------------
Write one module here with a subclass of `backend.AttentionBackend`: its `name`, an
`unsupported(spec)` that says why it cannot serve a spec (devices, dtypes, head sizes,
block sizes) or None, and a `build(step, out)` that turns a step's flattened tokens
into a `StepAttention` (the interface models call, `models/attention.py`) whose `attend`
writes the keys and values into the cache and attends. Then add the class to `BACKENDS` below, where its preference
falls. Models, the runner and the KV cache need no change (tests/engine/test_attention.py
runs every backend against transformers). It reads caches in the model's dtype; a
KV-cache format other than that lists the backends that read it (`worker/kv_cache/`).
"""

from __future__ import annotations

from tokenmill.engine.worker.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    StepTokens,
)
from tokenmill.engine.worker.attention.native import NativeBackend
from tokenmill.engine.worker.attention.portable import PortableBackend
from tokenmill.engine.worker.attention.triton import TritonBackend

# In order of preference: the native CPU kernels, the Triton kernels on CUDA, then the
# portable PyTorch path, which serves every spec with a cache in the model's dtype.
# Which of them read a KV-cache format is the format's to say (`KVCacheFormat.backends`).
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
    """The first backend of `BACKENDS` that reads the spec's KV-cache format and serves
    spec, the format holding the model's heads.

    Raises:
        ValueError: none does; the message gives each backend's reason.
    """
    kv_format = spec.kv_format
    reasons = []
    for backend in BACKENDS:
        if spec.attention_sinks and not backend.computes_sinks:
            reason = "does not compute attention sinks (gpt-oss)"
        elif kv_format.served_by(backend.name):
            reason = backend.unsupported(spec) or kv_format.unsupported(
                spec.head_dim, spec.block_size
            )
        else:
            reason = f"does not read a {kv_format.name} KV cache"
        if reason is None:
            return backend(spec)
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(
        f"no attention backend serves this model here (kv_cache_dtype "
        f"{kv_format.name!r}, {spec.dtype}, {spec.device}): " + "; ".join(reasons)
    )


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionSpec",
    "StepTokens",
    "backend_named",
    "select_backend",
]
