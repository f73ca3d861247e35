"""The GGUF 4-bit layers' forward over the native library (q4_linear.c: AVX512-VNNI,
AVX-VNNI or AVX2): the rows quantized in blocks of 32, the integer product on the
blocks' nibbles and their scales in one call."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import kernel_isa, native_library
from tokenmill.engine.kernels.interface import (
    Q4LinearArgs,
    Q4PackGGUFArgs,
    Q4UnpackArgs,
    check_status,
)
from tokenmill.engine.kernels.linear_calls import checked_activations, reused_buffers

PANEL = 16  # output channels per packed panel
BLOCK = 32  # k-values per block: one scale (and minimum) per channel and block
_NIBBLE_BYTES = PANEL * BLOCK // 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_library().lib if native_q4_isa() is not None else None


def native_q4_isa() -> str | None:
    """The instructions the native 4-bit linear runs on here (None: not built for this
    CPU, or no native library)."""
    return kernel_isa("q4_linear_isa")


def takes_shape(out_features: int, in_features: int) -> bool:
    """Whether the native 4-bit linear takes a layer of this shape on this machine."""
    return (
        _library() is not None
        and out_features % PANEL == 0
        and in_features % BLOCK == 0
        and in_features <= native_library().limits.max_int8_k
    )


@dataclass(frozen=True)
class PackedQ4Weight:
    """A 4-bit weight [n, k] in the kernel's layout (q4_linear.c): per 16-channel panel,
    k / 32 blocks of nibbles, fp16 scales and (affine) fp16 minimums."""

    blocks: torch.Tensor  # uint8 [n / 16, k / 32, 288 or 320]
    bias: torch.Tensor | None  # fp32 [n]
    out_features: int
    in_features: int
    affine: bool  # minimums stored (Q4_1); else min = -8 * scale (Q4_0)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + (0 if self.bias is None else 4 * self.bias.numel())


def tiles_available() -> bool:
    """Whether q4_linear_tiles runs here (AMX bf16 tiles built and granted)."""
    native = native_library()
    return native is not None and native.limits.q4_linear_tiles


def exact_in_fp16(values: torch.Tensor) -> bool:
    """Whether every value survives a round trip through fp16 unchanged (the kernel keeps
    scales and minimums in fp16, as GGUF's Q4_0 and Q4_1 blocks do)."""
    return bool(torch.equal(values.float().half().float(), values.float()))


def pack_q4_weight(
    q: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> PackedQ4Weight:
    """4-bit weights (q in 0..15 [n, k], weight = scale * q + minimum per block of 32
    along k; minimum None for symmetric blocks, where it is -8 * scale) -> the layout
    tm_q4_linear reads. n % 16 == 0, k % 32 == 0; scale and minimum [n, k / 32], each
    exact in fp16 (exact_in_fp16), so the kernel computes with the file's own values.
    """
    n, k = q.shape
    if n % PANEL or k % BLOCK:
        raise ValueError(
            f"a 4-bit weight needs n % {PANEL} == 0 and k % {BLOCK} == 0, not {n} x {k}"
        )
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError("4-bit weights must lie in 0..15")
    for name, values in (("scales", scale), ("minimums", minimum)):
        if values is not None and not exact_in_fp16(values):
            raise ValueError(f"the 4-bit kernel keeps {name} in fp16; these are not exact in it")
    nb = k // BLOCK
    # [panels, 16 channels, blocks, 8 k-steps, 4] -> [panels, blocks, k-step, channel, 4]
    steps = q.to(torch.uint8).reshape(n // PANEL, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4)
    nibbles = (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(n // PANEL, nb, _NIBBLE_BYTES)

    def per_panel(values: torch.Tensor) -> torch.Tensor:  # [n, nb] -> [panels, nb, 32 bytes]
        half = values.float().half().reshape(n // PANEL, PANEL, nb).transpose(1, 2)
        return half.contiguous().view(torch.uint8).reshape(n // PANEL, nb, 2 * PANEL)

    parts = [nibbles, per_panel(scale)]
    if minimum is not None:
        parts.append(per_panel(minimum))
    return PackedQ4Weight(
        blocks=torch.cat(parts, dim=2).contiguous(),
        bias=None if bias is None else bias.detach().float().contiguous(),
        out_features=n,
        in_features=k,
        affine=minimum is not None,
    )


def pack_gguf_q4_weight(
    raw: torch.Tensor, affine: bool, bias: torch.Tensor | None = None
) -> PackedQ4Weight:
    """GGUF Q4_0 (affine False) or Q4_1 rows, raw uint8 [n, k / 32 * 18 or 20 bytes] ->
    the layout tm_q4_linear reads, in one native pass (kernels.h: tm_q4_pack_gguf): the
    bytes pack_q4_weight writes from the rows' decoded codes, scales and minimums, without
    decoding them. n % 16 == 0 (takes_shape)."""
    nbytes = 20 if affine else 18
    n, width = raw.shape
    if raw.dtype != torch.uint8 or width % nbytes or n % PANEL:
        raise ValueError(f"GGUF 4-bit rows must be uint8 whole blocks, n % {PANEL} == 0")
    nb = width // nbytes
    raw = raw.contiguous()
    blocks = torch.empty(
        n // PANEL, nb, _NIBBLE_BYTES + (4 if affine else 2) * PANEL, dtype=torch.uint8
    )
    args = Q4PackGGUFArgs(
        raw=raw.data_ptr(),
        out=blocks.data_ptr(),
        n=n,
        k=nb * BLOCK,
        affine=int(affine),
        num_threads=torch.get_num_threads(),
    )
    check_status(native_library().lib.tm_q4_pack_gguf(ctypes.byref(args)), "GGUF 4-bit pack")
    return PackedQ4Weight(
        blocks=blocks,
        bias=None if bias is None else bias.detach().float().contiguous(),
        out_features=n,
        in_features=nb * BLOCK,
        affine=affine,
    )


def q4_linear(
    x: torch.Tensor, weight: PackedQ4Weight, *, keep_quantized: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = blockwise-quantized(x) @ weight.T + bias, in x's dtype (kernels.h states the
    arithmetic).

    Args:
        x: [rows, k] fp32 or bf16 activations.
        weight: from pack_q4_weight.
        keep_quantized: also return the quantized activations (int8 [rows, k]), their
            block scales (fp32 [rows, k / 32]) and block sums (int32 [rows, k / 32]).
    Returns:
        y [rows, n], or (y, qx, x_scales, x_sums) with keep_quantized.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the native 4-bit linear is not built for this CPU")
    k, n = weight.in_features, weight.out_features
    x = checked_activations(x, k, "4-bit linear")
    rows = x.shape[0]
    if keep_quantized:
        qx = torch.empty((rows, k), dtype=torch.int8)
        x_scales = torch.empty((rows, k // BLOCK), dtype=torch.float32)
        x_sums = torch.empty((rows, k // BLOCK), dtype=torch.int32)
    else:
        blocks = rows * k // BLOCK
        qx, x_scales, x_sums = reused_buffers(
            "q4_linear", ((rows * k, torch.int8), (blocks, torch.float32), (blocks, torch.int32))
        )
    out = torch.empty((rows, n), dtype=x.dtype)
    args = Q4LinearArgs(
        x=x.data_ptr(),
        qx=qx.data_ptr(),
        x_scales=x_scales.data_ptr(),
        x_sums=x_sums.data_ptr(),
        w=weight.blocks.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        n=n,
        k=k,
        is_bf16=int(x.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        affine=int(weight.affine),
    )
    check_status(lib.tm_q4_linear(ctypes.byref(args)), "4-bit linear")
    if keep_quantized:
        return out, qx, x_scales, x_sums
    return out


def unpack_q4_bf16(weight: PackedQ4Weight) -> torch.Tensor:
    """The weight expanded to bf16 [n, k] (kernels.h: tm_q4_unpack_bf16), for one bf16
    matmul."""
    native = native_library()
    if native is None:
        raise RuntimeError("the native kernels are not built here")
    out = torch.empty((weight.out_features, weight.in_features), dtype=torch.bfloat16)
    args = Q4UnpackArgs(
        w=weight.blocks.data_ptr(),
        out=out.data_ptr(),
        n=weight.out_features,
        k=weight.in_features,
        affine=int(weight.affine),
        num_threads=torch.get_num_threads(),
    )
    check_status(native.lib.tm_q4_unpack_bf16(ctypes.byref(args)), "4-bit unpack")
    return out


def q4_linear_tiles(x: torch.Tensor, weight: PackedQ4Weight) -> torch.Tensor:
    """y = x @ dequantized(weight).T + bias on AMX tiles (kernels.h: tm_q4_linear_tiles):
    the blocks' exact fp32 values, fp32 sums, bf16 out.

    Args:
        x: [rows, k] bf16 activations.
        weight: from pack_q4_weight.
    Returns:
        y [rows, n] bf16.
    """
    if not tiles_available():
        raise RuntimeError("the 4-bit linear on AMX tiles does not run on this CPU")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the 4-bit linear on AMX tiles takes bf16 rows, not {x.dtype}")
    x = checked_activations(x, weight.in_features, "4-bit linear on tiles")
    out = torch.empty((x.shape[0], weight.out_features), dtype=torch.bfloat16)
    args = Q4LinearArgs(
        x=x.data_ptr(),
        w=weight.blocks.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(),
        out=out.data_ptr(),
        rows=x.shape[0],
        n=weight.out_features,
        k=weight.in_features,
        is_bf16=1,
        num_threads=torch.get_num_threads(),
        affine=int(weight.affine),
    )
    status = native_library().lib.tm_q4_linear_tiles(ctypes.byref(args))
    check_status(status, "4-bit linear on tiles")
    return out
