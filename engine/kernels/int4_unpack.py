"""Python side of int4_unpack.c: int4 weights in PyTorch's CPU int4pack layout expanded
to a transposed bf16 weight for one product, and float weights quantized into that
layout in one pass at load (engine/quant/int4.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import Int4PackArgs, Int4UnpackArgs, check_status

# Output channels per block of torch's CPU int4pack layout (int4_unpack.c).
BLOCK_N = 64
# The largest group quantize_pack_int4 takes (kernels.h's TM_INT4_MAX_GROUP).
MAX_PACK_GROUP = 256


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


def quantize_pack_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A float weight [N, K] (bf16 or fp32, N a multiple of 64) quantized in groups of
    `group_size` inputs and packed: (uint8 [N, K / 2] in the int4pack layout, fp32 scale
    [N, K / g], fp32 minimum [N, K / g]) - the codes int4.py's quantize_weight makes, to the
    bit, packed as torch packs them where int4.py has checked its layout. None where a
    group holds a NaN or an infinity (its scale or minimum is not finite): the caller's
    own path then decides, as it would have without this one."""
    n, k = weight.shape
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"int4 packing takes bf16 or fp32 weights, not {weight.dtype}")
    weight = weight.detach().contiguous()
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scale = torch.empty(n, k // group_size)
    minimum = torch.empty(n, k // group_size)
    num_nonfinite = ctypes.c_int64(0)
    args = Int4PackArgs(
        weight=weight.data_ptr(),
        packed=packed.data_ptr(),
        scale=scale.data_ptr(),
        minimum=minimum.data_ptr(),
        num_nonfinite=ctypes.addressof(num_nonfinite),
        n=n,
        k=k,
        group=group_size,
        is_bf16=int(weight.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
    )
    check_status(_library().tm_int4_pack(ctypes.byref(args)), f"int4 pack {n} x {k}")
    if num_nonfinite.value:
        return None
    return packed, scale, minimum
