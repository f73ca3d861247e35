"""Python side of fp8_linear.c: a linear layer on FP8 (e4m3) codes and block scales,
dequantized inside the kernel (engine/quant/checkpoint/fp8.py builds the layers). Where
the native library is not built, the same product in PyTorch: a tile of output rows
dequantized to fp32 at a time. That is also the route of calls of TILES_MIN_ROWS rows or
more that the kernel would run on its plain fp32 loops (fp32 inputs anywhere; bf16 inputs
on a build without AVX512-BF16, such as Ice Lake's): those loops read two operands per
multiply-add, while the tiles pay a fixed dequantization and then run PyTorch's fp32 GEMM
(docs/design.md, "Long FP8 calls on fp32 tiles")."""

from __future__ import annotations

import ctypes
import functools

import torch
from torch.nn import functional as F

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import FP8_LINEAR_ISAS, Fp8LinearArgs, check_status

# Output rows the PyTorch path dequantizes at once: 256 x 4,096 inputs is 4 MB of fp32.
_FALLBACK_ROWS = 256
# From this many rows a call the kernel would run on its fp32 loops runs on PyTorch's
# tiles instead (module docstring).
TILES_MIN_ROWS = 256
# The paths on the CPU's bf16 dot products (fp8_bf16.h), by tm_limits' name.
_BF16_ISAS = ("avx512_bf16", "amx_bf16+avx512_bf16")
_ISA_CODES = {name: code for code, name in FP8_LINEAR_ISAS.items()}


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def native_isa() -> str | None:
    """The native kernel's path here (FP8_LINEAR_ISAS' names), or None without the library."""
    native = native_library()
    return None if native is None else native.limits.fp8_linear_isa


def kernel_name() -> str:
    """What runs the product here, in words (`tokenmill models info`)."""
    native = native_library()
    if native is None:
        return "PyTorch, a tile of rows dequantized to fp32 at a time"
    isa = native.limits.fp8_linear_isa
    tiles = f"; calls of {TILES_MIN_ROWS} rows or more on those in PyTorch, tiles dequantized"
    if isa in _BF16_ISAS:
        return (
            f"native fp8 kernel ({isa} for bf16 inputs, codes decoded to bf16; "
            f"fp32 inputs on fp32 loops{tiles}), dequantized in the kernel"
        )
    return f"native fp8 kernel ({isa}{tiles}), dequantized in the kernel"


def runs_on_tiles(rows: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows of `dtype` runs on PyTorch's tiles rather than the
    native kernel: TILES_MIN_ROWS rows or more where the kernel would take its fp32 loops."""
    if _library() is None:
        return True
    bf16_dots = dtype == torch.bfloat16 and native_isa() in _BF16_ISAS
    return rows >= TILES_MIN_ROWS and not bf16_dots


def dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], lo: int, hi: int
) -> torch.Tensor:
    """Output rows [lo, hi) of the weight in fp32: each code's e4m3 value times its
    block's scale, one fp32 product each (what the kernel computes)."""
    block_n, block_k = block
    k = codes.shape[1]
    values = codes[lo:hi].view(torch.float8_e4m3fn).float()
    row_blocks = torch.arange(lo, hi) // block_n
    col_blocks = torch.arange(k) // block_k
    return values.mul_(scales[row_blocks][:, col_blocks])


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    max_isa: str | None = None,
) -> torch.Tensor:
    """x @ dequant(codes)^T + bias.

    Args:
        x: fp32 or bf16 [rows, k], contiguous.
        codes: uint8 [n, k], e4m3 bit patterns with no NaN among them.
        scales: fp32 [ceil(n / block_n), ceil(k / block_k)].
        block: (block_n, block_k), the outputs and inputs one scale covers.
        bias: fp32 [n] or None.
        max_isa: the fastest native path the call may take, by FP8_LINEAR_ISAS' name
            ("generic" pins the plain loops); None: the best this CPU has, or PyTorch's
            tiles where those are the plain loops and the call has TILES_MIN_ROWS rows.
    Returns:
        [rows, n] in x's dtype.
    """
    rows, k = x.shape
    n = codes.shape[0]
    lib = _library()
    if lib is None or (max_isa is None and runs_on_tiles(rows, x.dtype)):
        out = torch.empty(rows, n)
        xf = x.float()
        for lo in range(0, n, _FALLBACK_ROWS):
            hi = min(lo + _FALLBACK_ROWS, n)
            part_bias = None if bias is None else bias[lo:hi]
            out[:, lo:hi] = F.linear(xf, dequantize_rows(codes, scales, block, lo, hi), part_bias)
        return out.to(x.dtype)
    out = torch.empty(rows, n, dtype=x.dtype)
    args = Fp8LinearArgs(
        x=x.data_ptr(),
        w=codes.data_ptr(),
        scales=scales.data_ptr(),
        bias=None if bias is None else bias.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        n=n,
        k=k,
        block_n=block[0],
        block_k=block[1],
        is_bf16=int(x.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        max_isa=_ISA_CODES[max_isa] if max_isa else max(FP8_LINEAR_ISAS),
    )
    check_status(lib.tm_fp8_linear(ctypes.byref(args)), f"fp8 linear {k} -> {n}")
    return out
