"""Python side of argmax.c: torch.argmax over the rows of fp32 CPU logits, in one native
pass per row instead of PyTorch's value-at-a-time loop (greedy decoding's whole cost in
the sampler)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import ArgmaxArgs, check_status


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [rows, n]: the first largest value's index per row,
    or the first NaN's where a row has one; int64 [rows]. Falls back to torch.argmax
    where the native kernel does not take x (not fp32, not CPU, not 2-D, no compiler)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return x.argmax(dim=-1)
    lib = _library()
    if lib is None:
        return x.argmax(dim=-1)
    if x.shape[1] == 0:
        raise ValueError("argmax of an empty row")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    args = ArgmaxArgs(
        x=x.data_ptr(),
        out=out.data_ptr(),
        rows=x.shape[0],
        n=x.shape[1],
        num_threads=torch.get_num_threads(),
    )
    check_status(lib.tm_argmax_rows(ctypes.byref(args)), f"argmax over {x.shape[1]} values")
    return out
