"""The engine's CUDA kernels and step machinery: Triton paged attention and KV-cache stores,
CUDA-graph decode steps. The scheduler, prefix cache, sampler and models are the same as on
the CPU; only the kernels under them differ.

Triton is imported lazily: a CPU-only install never needs it. The kernels also run under
Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is how the test suite
checks them on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (it ships with PyTorch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def uses_triton(device: torch.device) -> bool:
    """Whether a model on `device` runs its attention through the Triton kernels."""
    return device.type == "cuda" and triton_available()
