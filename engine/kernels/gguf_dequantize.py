"""Python side of gguf_dequantize.c: GGUF Q4_0, Q4_1 and Q8_0 blocks decoded to fp32 or
bf16 in one native pass (engine/loader/gguf_tensors.py's float tensors)."""

from __future__ import annotations

import ctypes

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import GGUFDequantizeArgs, check_status

# GGML type name -> (kernels.h's TM_GGUF_* kind, bytes per block of 32 weights).
KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}


def available() -> bool:
    """Whether the native decoding is built here."""
    return native_library() is not None


def dequantize_blocks(
    raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """raw uint8 [rows, bytes per row] of GGML type `kind` (one of KINDS) -> [rows, 32 *
    blocks per row] in `dtype`: each weight as gguf.quants' dequantize computes it, and in
    bf16 that value rounded as `.to(torch.bfloat16)` rounds it - written straight to bf16,
    without an fp32 tensor (a 128k-token embedding's is 2 GB)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"GGUF blocks decode to float32 or bfloat16, not {dtype}")
    code, nbytes = KINDS[kind]
    rows, width = raw.shape
    if raw.dtype != torch.uint8 or width % nbytes:
        raise ValueError(f"{kind} rows must be uint8 whole blocks of {nbytes} bytes")
    raw = raw.contiguous()
    out = torch.empty(rows, width // nbytes * 32, dtype=dtype)
    args = GGUFDequantizeArgs(
        blocks=raw.data_ptr(),
        out=out.data_ptr(),
        num_blocks=rows * (width // nbytes),
        kind=code,
        num_threads=torch.get_num_threads(),
        bf16=int(dtype == torch.bfloat16),
    )
    check_status(native_library().lib.tm_gguf_dequantize(ctypes.byref(args)), f"{kind} decode")
    return out
