"""Python side of packed_matvec.c: one bf16 row through a linear weight oneDNN packed, read
where it lies (engine/quant/packed_linear.py decides when the layout holds)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import PackedMatvecArgs, check_status

# The output block widths the kernel reads (kernels.h).
BLOCK_COLS = (16, 32, 64)


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def vectorized() -> bool:
    """Whether the kernel runs vdpbf16ps here; its plain-loop build is slower than oneDNN,
    so the engine uses it only where this holds."""
    native = native_library()
    return native is not None and native.limits.packed_matvec_vector


def _storage(weight: torch.Tensor) -> tuple[int, int]:
    """(address, size in bytes) of a weight's values: a oneDNN-packed (mkldnn) tensor's
    opaque storage, or a dense tensor's."""
    if weight.is_mkldnn:
        ops = torch.ops.mkldnn
        if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
            raise ValueError("this torch build does not expose a packed weight's storage")
        return ops.data_ptr(weight), ops._nbytes(weight)
    if not weight.is_contiguous():
        raise ValueError("a dense weight must be contiguous")
    return weight.data_ptr(), weight.numel() * weight.element_size()


class PackedMatvec:
    """The call for one layer: its weight and shape fixed once, so a decode step's call
    sets only the row's pointers.

    Args:
        weight: bf16 in the layout kernels.h gives (tm_packed_matvec): the tensor
            torch.ops.mkldnn._reorder_linear_weight returned, or a dense tensor holding
            that layout (tests build those). Kept referenced, so its storage outlives the
            call.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        in_features: int,
        out_features: int,
        block_cols: int,
        bias: torch.Tensor | None,
    ) -> None:
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"the weight must be bf16, not {weight.dtype}")
        address, size = _storage(weight)
        if size != in_features * out_features * 2:
            raise ValueError(
                f"the weight holds {size} bytes, not {out_features} x {in_features} bf16"
            )
        if block_cols not in BLOCK_COLS:
            raise ValueError(f"block_cols must be one of {BLOCK_COLS}, not {block_cols}")
        if in_features % 2 or out_features % block_cols:
            raise ValueError(
                f"{out_features} x {in_features} is not {block_cols}-column blocks of pairs of k"
            )
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            raise ValueError("the bias must be contiguous bf16")
        self.weight = weight
        self.out_features = out_features
        self.in_features = in_features
        self._bias = bias  # kept alive: the struct holds its address
        self._what = f"packed matvec {in_features} -> {out_features}"
        self._args = PackedMatvecArgs(
            w=address,
            bias=None if bias is None else bias.data_ptr(),
            in_features=in_features,
            out_features=out_features,
            block_cols=block_cols,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: bf16, contiguous, in_features values (any leading shape of one row) ->
        bf16 [..., out_features]."""
        y = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.bfloat16)
        args = self._args
        args.x = x.data_ptr()
        args.y = y.data_ptr()
        args.num_threads = torch.get_num_threads()
        check_status(_library().tm_packed_matvec(ctypes.byref(args)), self._what)
        return y
