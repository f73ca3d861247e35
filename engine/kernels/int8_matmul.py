"""The int8 x int8 matrix product of the int8 linear layers, over the native library
(int8_matmul.c, AVX512-VNNI): per-row activation scales and per-channel weight scales
applied in one epilogue."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import Int8MatmulArgs, check_status

PANEL = 16  # output channels per packed panel
K_STEP = 4  # k-values per vpdpbusd lane


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    if native is None or native.limits.int8_matmul_isa is None:
        return None
    return native.lib


def native_int8_isa() -> str | None:
    """The instructions the native int8 product runs on here (None: not built for
    this CPU, or no native library)."""
    native = native_library()
    return None if native is None else native.limits.int8_matmul_isa


def takes_shape(out_features: int, in_features: int) -> bool:
    """Whether the native product takes a layer of this shape on this machine."""
    native = native_library()
    return (
        _library() is not None
        and out_features % PANEL == 0
        and in_features % K_STEP == 0
        and in_features <= native.limits.max_int8_k
    )


@dataclass(frozen=True)
class PackedInt8Weight:
    """An int8 weight [n, k] in the kernel's layout, with what its epilogue needs."""

    panels: torch.Tensor  # int8 [n / 16, k / 4, 16, 4]
    col_sums: torch.Tensor  # int32 [n]: sum over k of each output channel's weights
    scales: torch.Tensor  # fp32 [n]
    bias: torch.Tensor | None  # fp32 [n]

    @property
    def out_features(self) -> int:
        return self.col_sums.numel()

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * K_STEP


def pack_int8_weight(
    qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> PackedInt8Weight:
    """int8 [n, k] (n % 16 == 0, k % 4 == 0) -> the panels tm_int8_matmul reads."""
    n, k = qweight.shape
    panels = qweight.reshape(n // PANEL, PANEL, k // K_STEP, K_STEP).permute(0, 2, 1, 3)
    return PackedInt8Weight(
        panels=panels.contiguous(),
        col_sums=qweight.sum(dim=1, dtype=torch.int32).contiguous(),
        scales=scales.float().contiguous(),
        bias=None if bias is None else bias.float().contiguous(),
    )


def int8_matmul(
    qx: torch.Tensor,
    x_scales: torch.Tensor,
    x_zero_point: int,
    weight: PackedInt8Weight,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(qx - zero_point) * x_scales[:, None] @ (weight * scales[:, None]).T + bias.

    Args:
        qx: uint8 [rows, k] from quantize_rows_u8.
        x_scales: fp32 [rows].
        x_zero_point: the uint8 value that stands for 0.
        weight: from pack_int8_weight.
        out_dtype: torch.float32 or torch.bfloat16.
    Returns:
        [rows, n] in out_dtype.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int8 product is not built for this CPU")
    if qx.dtype != torch.uint8 or qx.dim() != 2 or qx.shape[1] != weight.in_features:
        raise ValueError(f"expected uint8 [rows, {weight.in_features}] activations")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the int8 product writes float32 or bfloat16, not {out_dtype}")
    qx, x_scales = qx.contiguous(), x_scales.float().contiguous()
    rows = qx.shape[0]
    if x_scales.shape != (rows,):
        raise ValueError(f"expected {rows} activation scales, got {tuple(x_scales.shape)}")
    out = torch.empty((rows, weight.out_features), dtype=out_dtype)
    args = Int8MatmulArgs(
        x=qx.data_ptr(),
        x_scales=x_scales.data_ptr(),
        w=weight.panels.data_ptr(),
        w_col_sums=weight.col_sums.data_ptr(),
        w_scales=weight.scales.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        n=weight.out_features,
        k=weight.in_features,
        x_zero_point=x_zero_point,
        is_bf16=int(out_dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
    )
    check_status(lib.tm_int8_matmul(ctypes.byref(args)), "int8 matmul (AVX512-VNNI)")
    return out
