"""Python side of int4_unpack.c: int4 weights in PyTorch's CPU int4pack layout expanded
to a transposed bf16 weight for one product (engine/quant/int4.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import Int4UnpackArgs, check_status

# Output channels per block of torch's CPU int4pack layout (int4_unpack.c).
BLOCK_N = 64


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def available() -> bool:
    """Whether the native unpacking is built here."""
    return _library() is not None


def unpack_int4_bf16(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The bf16 weight, transposed: [K, N] with w[k, n] = (q[n, k] - 8) * scale + zero.

    Args:
        packed: uint8 [N, K / 2] from torch's _convert_weight_to_int4pack_for_cpu, N a
            multiple of 64.
        scales_and_zeros: bf16 [K / group_size, N, 2] (scale, zero) per group and channel.
    """
    n = packed.shape[0]
    k = packed.shape[1] * 2
    if scales_and_zeros.dtype != torch.bfloat16 or scales_and_zeros.shape != (
        k // group_size,
        n,
        2,
    ):
        raise ValueError("scales_and_zeros must be bf16 [K / group, N, 2]")
    if packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError("packed must be the contiguous uint8 int4pack tensor")
    out = torch.empty((k, n), dtype=torch.bfloat16)
    args = Int4UnpackArgs(
        packed=packed.data_ptr(),
        scales_and_zeros=scales_and_zeros.contiguous().data_ptr(),
        out=out.data_ptr(),
        n=n,
        k=k,
        group=group_size,
        num_threads=torch.get_num_threads(),
    )
    check_status(_library().tm_int4_unpack_bf16(ctypes.byref(args)), f"int4 unpack {n} x {k}")
    return out
