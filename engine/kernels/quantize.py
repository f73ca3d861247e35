"""Dynamic per-row int8 quantization of activations, over the native library
(quantize.c): the int8 linear layers' input step."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import QuantizeArgs, check_status

# (largest magnitude, the uint8 value that stands for 0.0): all 8 bits, or 7 bits for
# CPUs whose int8 dot products sum pairs into int16 (AVX2's vpmaddubsw saturates when
# 255 * 127 * 2 > 32767; 127 * 127 * 2 fits).
FULL_RANGE = (127, 128)
REDUCED_RANGE = (63, 64)
# How a row's scale and codes are chosen from its largest magnitude m: "symmetric" - the
# int8 mode's own, m / qmax and codes -qmax..qmax; "full" - m / (qmax + 0.5) and codes
# -(qmax + 1)..qmax, every code of the range, as compressed-tensors quantizes a token
# (127.5, -128..127) - what its W8A8 checkpoints were made with.
ROUNDINGS = ("symmetric", "full")


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def quantize_rows_u8(
    x: torch.Tensor,
    inv_smooth: torch.Tensor | None = None,
    value_range: tuple[int, int] = FULL_RANGE,
    rounding: str = "symmetric",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, dim] (fp32 or bf16, CPU) -> (uint8 [rows, dim], fp32 scales [rows]) with
    x * inv_smooth ~ (q - zero_point) * scales[:, None].

    Args:
        x: the activations.
        inv_smooth: [dim] fp32 per-channel factors applied first, or None.
        value_range: (qmax, zero_point), FULL_RANGE or REDUCED_RANGE.
        rounding: one of ROUNDINGS.
    Returns:
        The values and each row's scale, max|x * inv_smooth| / qmax (or qmax + 0.5,
        rounding "full"). The native kernel
        does it in one call where the library is built; PyTorch ops otherwise (the same
        rounding, half to even).
    """
    qmax, zero_point = value_range
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown activation rounding {rounding!r}; choose from {ROUNDINGS}")
    full = rounding == "full"
    x = x.contiguous()
    rows, dim = x.shape
    lib = _library()
    if lib is not None and x.dtype in (torch.float32, torch.bfloat16):
        out = torch.empty((rows, dim), dtype=torch.uint8)
        scales = torch.empty(rows, dtype=torch.float32)
        args = QuantizeArgs(
            x=x.data_ptr(),
            inv_smooth=None if inv_smooth is None else inv_smooth.data_ptr(),
            out=out.data_ptr(),
            scales=scales.data_ptr(),
            rows=rows,
            dim=dim,
            is_bf16=int(x.dtype == torch.bfloat16),
            qmax=qmax,
            zero_point=zero_point,
            num_threads=torch.get_num_threads(),
            full_range=int(full),
        )
        check_status(lib.tm_quantize_rows_u8(ctypes.byref(args)), f"value range {value_range}")
        return out, scales
    x = x.float() if inv_smooth is None else x.float() * inv_smooth
    absmax = x.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / (qmax + 0.5 * full), torch.ones_like(absmax))
    scaled = x / scales[:, None] if full else x * (1.0 / scales)[:, None]
    q = torch.round(scaled).clamp_(-qmax - full, qmax).add_(zero_point)
    return q.to(torch.uint8), scales
