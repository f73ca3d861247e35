"""What the native linear layers' wrappers (int8_linear.py, q4_linear.py) share: the check
of the activations they are called with, and the per-thread buffers their kernels quantize
those activations into.

The buffers are only ever read by the kernel that wrote them, so they are reused from call
to call: allocating them was a large share of a decode-sized call's Python
(docs/design.md, "Our own int8 kernel"). They are kept per thread, since a process may run
models in several threads (notebooks, threaded Dask workers), and grown with headroom so
that a run's rising row counts reallocate them a few times only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_buffers = threading.local()
_MIN_ELEMENTS = 1 << 16


def checked_activations(x: torch.Tensor, k: int, layer: str) -> torch.Tensor:
    """x as the kernels take it (contiguous [rows, k], fp32 or bf16); ValueError otherwise.

    Args:
        layer: the layer's name in messages ("int8 linear").
    """
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the {layer} takes float32 or bfloat16, not {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected [rows, {k}] activations, got {tuple(x.shape)}")
    return x.contiguous()


def reused_buffers(owner: str, sizes: Sequence[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """This thread's flat buffers for `owner`, one of at least each (elements, dtype)."""
    buffers = getattr(_buffers, owner, None)
    if buffers is not None:
        for buffer, (elements, _) in zip(buffers, sizes):
            if buffer.numel() < elements:
                break
        else:
            return buffers
    buffers = [torch.empty(max(2 * n, _MIN_ELEMENTS), dtype=dtype) for n, dtype in sizes]
    setattr(_buffers, owner, buffers)
    return buffers
