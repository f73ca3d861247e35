"""The int8 linear layers' forward over the native library (int8_linear.c: AVX512-VNNI,
AMX, or AVX2): per-row activation quantization, the int8 product and both scales in one
call."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import kernel_isa, native_library
from tokenmill.engine.kernels.interface import Int8LinearArgs, check_status
from tokenmill.engine.kernels.linear_calls import checked_activations, reused_buffers
from tokenmill.engine.kernels.quantize import FULL_RANGE

PANEL = 16  # output channels per packed panel
K_STEP = 4  # k-values per vpdpbusd lane
# The kernel quantizes activations to all 8 bits on every instruction set it has (AVX2
# multiplies them as signed values, which its int16 step holds: int8_avx2.h);
# int8_linear.c hard-codes this range.
VALUE_RANGE = FULL_RANGE
# Activations the kernel applies to a gated MLP's gate in its epilogue (HF config names ->
# TM_GATED_*), multiplying by up: SiLU-and-mul fused into the gate_up product.
GATED_ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_library().lib if native_int8_isa() is not None else None


def native_int8_isa() -> str | None:
    """The instructions the native int8 linear runs on here (None: not built for this
    CPU, or no native library)."""
    return kernel_isa("int8_linear_isa")


def takes_shape(out_features: int, in_features: int) -> bool:
    """Whether the native int8 linear takes a layer of this shape on this machine."""
    return (
        _library() is not None
        and out_features % PANEL == 0
        and in_features % K_STEP == 0
        and in_features <= native_library().limits.max_int8_k
    )


def takes_full_rounding() -> bool:
    """Whether the kernel here quantizes activations with the "full" rounding (codes down
    to -128): every build but plain AVX2's, whose sign trick has no -128 (int8_avx2.h)."""
    return native_int8_isa() not in (None, "avx2")


def takes_gated(out_features: int, in_features: int) -> bool:
    """Whether the kernel here can apply a gated MLP's activation in its epilogue, for a
    gate_up weight of this shape (gate and up halves of 16-channel panels each): every
    build that has the product can."""
    return takes_shape(out_features, in_features) and out_features % (2 * PANEL) == 0


@dataclass(frozen=True)
class PackedInt8Weight:
    """An int8 weight [n, k] in the kernel's layout, with what its epilogue needs. Every
    per-channel field is in the panels' channel order."""

    panels: torch.Tensor  # int8 [n / 16, k / 4, 16, 4]
    col_sums: torch.Tensor  # int32 [n]: sum over k of each output channel's weights
    scales: torch.Tensor  # fp32 [n]
    bias: torch.Tensor | None  # fp32 [n]
    # The weight's two halves (gate, up) interleaved a panel at a time: panel 2i holds gate
    # channels 16i.., panel 2i + 1 the up channels for them (pack_int8_weight(gated=True)).
    gated: bool = False

    @property
    def out_features(self) -> int:
        return self.col_sums.numel()

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * K_STEP


def pack_int8_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> PackedInt8Weight:
    """int8 [n, k] (n % 16 == 0, k % 4 == 0) -> the panels tm_int8_linear reads.

    gated: the rows are a gated MLP's [gate; up] (n % 32 == 0), to be packed a panel of
    each in turn so that the kernel can apply the activation (int8_linear(activation=)).
    """
    n, k = qweight.shape
    order = gated_channel_order(n) if gated else None
    if order is not None:
        qweight, scales = qweight[order], scales[order]
        bias = None if bias is None else bias[order]
    return PackedInt8Weight(
        panels=_panels(qweight),
        col_sums=qweight.sum(dim=1, dtype=torch.int32).contiguous(),
        scales=scales.float().contiguous(),
        bias=None if bias is None else bias.float().contiguous(),
        gated=gated,
    )


def _panels(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [n, k] -> [n / PANEL, k / K_STEP, PANEL, K_STEP]: for each panel of PANEL
    rows, K_STEP inputs of each row in turn. Moved as int32 words (a K_STEP run of
    int8s is one): the same bytes, and torch's copy of a permuted int8 tensor whose
    innermost run is 4 bytes long is about three times slower."""
    n, k = qweight.shape
    words = qweight.contiguous()
    if K_STEP != 4 or words.storage_offset() % 4:
        panels = words.reshape(n // PANEL, PANEL, k // K_STEP, K_STEP).permute(0, 2, 1, 3)
        return panels.contiguous()
    words = words.view(torch.int32).reshape(n // PANEL, PANEL, k // K_STEP)
    return (
        words.permute(0, 2, 1)
        .contiguous()
        .view(torch.int8)
        .view(n // PANEL, k // K_STEP, PANEL, K_STEP)
    )


def gated_channel_order(n: int) -> torch.Tensor:
    """The channels of a [gate; up] weight of n rows in gated packing order: 16 of gate,
    the 16 of up that go with them, and so on."""
    if n % (2 * PANEL):
        raise ValueError(f"a gated int8 weight needs a multiple of {2 * PANEL} rows, not {n}")
    half = n // 2
    gate = torch.arange(half).view(-1, PANEL)
    return torch.stack([gate, gate + half], dim=1).reshape(-1)


def int8_linear(
    x: torch.Tensor,
    weight: PackedInt8Weight,
    inv_smooth: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    keep_quantized: bool = False,
    rounding: str = "symmetric",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = quantized(x * inv_smooth) @ dequantized(weight).T + bias, in x's dtype, its
    channels in the weight's packed order; or, with an activation and a gated weight,
    act(gate) * up from those channels ([rows, n / 2], rounded once).

    Args:
        x: [rows, k] fp32 or bf16 activations.
        weight: from pack_int8_weight.
        inv_smooth: [k] fp32 factors applied to x first, or None.
        activation: a GATED_ACTIVATIONS name (needs takes_gated and a gated weight).
        keep_quantized: also return the quantized activations (uint8 [rows, k], around
            VALUE_RANGE's zero point) and their scales (fp32 [rows]) the product used.
        rounding: how the rows are quantized (kernels/quantize.py's ROUNDINGS); "full"
            where takes_full_rounding().
    Returns:
        y [rows, n], or (y, qx, x_scales) with keep_quantized.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int8 linear is not built for this CPU")
    k, n = weight.in_features, weight.out_features
    x = checked_activations(x, k, "int8 linear")
    if inv_smooth is not None and (inv_smooth.dtype != torch.float32 or inv_smooth.shape != (k,)):
        raise ValueError(f"expected float32 [{k}] smoothing factors")
    code, out_features = 0, n
    if activation is not None:
        if activation not in GATED_ACTIVATIONS or not weight.gated:
            raise ValueError(
                f"activation {activation!r} needs a gated weight and one of "
                f"{sorted(GATED_ACTIVATIONS)}"
            )
        code, out_features = GATED_ACTIVATIONS[activation], n // 2
    rows = x.shape[0]
    if keep_quantized:
        qx = torch.empty((rows, k), dtype=torch.uint8)
        x_scales = torch.empty(rows, dtype=torch.float32)
    else:
        qx, x_scales = reused_buffers(
            "int8_linear", ((rows * k, torch.uint8), (rows, torch.float32))
        )
    out = torch.empty((rows, out_features), dtype=x.dtype)
    args = Int8LinearArgs(
        x=x.data_ptr(),
        inv_smooth=None if inv_smooth is None else inv_smooth.contiguous().data_ptr(),
        qx=qx.data_ptr(),
        x_scales=x_scales.data_ptr(),
        w=weight.panels.data_ptr(),
        w_col_sums=weight.col_sums.data_ptr(),
        w_scales=weight.scales.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        n=n,
        k=k,
        is_bf16=int(x.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        activation=code,
        x_full_range=int(rounding == "full"),
    )
    check_status(lib.tm_int8_linear(ctypes.byref(args)), "int8 linear")
    return (out, qx, x_scales) if keep_quantized else out
