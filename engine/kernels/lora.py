"""Python side of lora.c: every run of rows' LoRA terms added to a layer's output in one
call (engine/lora/layers.py keeps the weights in the layout it reads)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import LoRAArgs, check_status

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def available(dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """Whether the native call serves a layer of this dtype, device and input width (bf16
    pairs its k, so needs an even one)."""
    if device.type != "cpu" or dtype not in DTYPES or _library() is None:
        return False
    return dtype != torch.bfloat16 or in_features % 2 == 0


def max_blocks() -> int:
    """Blocks (PEFT targets of one fused layer) an adapter may have in a layer."""
    return native_library().limits.lora_max_blocks


def to_pairs(t: torch.Tensor) -> torch.Tensor:
    """[k, n] -> [k / 2, n, 2]: rows 2i and 2i + 1 side by side, as vdpbf16ps takes them."""
    k, n = t.shape
    return t.view(k // 2, 2, n).transpose(1, 2).contiguous()


class LoRATables:
    """One layer's adapter weights and slot tables as the kernel reads them, checked and
    laid out once (the wrapper keeps one until its slots change), then called for each
    step's rows: a decode step makes 120 such calls on SmolLM2, and building the call's
    arguments each time cost more than some of the calls' arithmetic.

    Args:
        a: fp32 [slots, in, a_cols]; bf16 in pairs, [slots, in / 2, a_cols, 2] (`to_pairs`
            of each slot's).
        b: fp32 [slots, b_rows, b_cols]; bf16 [slots, b_rows / 2, b_cols, 2]; b_cols >= out,
            and padded as kernels.h asks where bf16 runs on AMX tiles.
        ranks: int64 [slots]: columns of a in use per slot.
        blocks: int64 [slots, max_blocks(), 4]: (col_lo, col_hi, out_lo, out_hi) each.
        num_blocks: int64 [slots].
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        ranks: torch.Tensor,
        blocks: torch.Tensor,
        num_blocks: torch.Tensor,
    ) -> None:
        is_bf16 = a.dtype == torch.bfloat16
        if a.dim() != (4 if is_bf16 else 3) or b.dim() != a.dim():
            raise ValueError("bf16 LoRA weights must be in pairs, fp32 ones plain")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("LoRA operands must be contiguous")
        if b.dtype != a.dtype:
            raise ValueError("LoRA operands must share one dtype")
        self.dtype = a.dtype
        self.in_features = a.shape[1] * (2 if is_bf16 else 1)
        self._keep = (a, b, ranks, blocks, num_blocks)  # the pointers below stay valid
        self._args = LoRAArgs(
            a=a.data_ptr(),
            b=b.data_ptr(),
            slot_ranks=ranks.data_ptr(),
            slot_blocks=blocks.data_ptr(),
            slot_num_blocks=num_blocks.data_ptr(),
            num_slots=a.shape[0],
            in_features=self.in_features,
            a_cols=a.shape[2],
            b_rows=b.shape[1] * 2 if is_bf16 else b.shape[1],
            b_cols=b.shape[2],
            is_bf16=int(is_bf16),
        )
        self._what = f"LoRA terms over {self.in_features} inputs"

    def add(self, x: torch.Tensor, y: torch.Tensor, runs: torch.Tensor) -> None:
        """y[first:end] += the term of the adapter in `slot`, for each (slot, first, end) run.

        Args:
            x: [rows, in], the tables' dtype, contiguous.
            y: [rows, out], x's type, contiguous: the base layer's output, added to in place.
            runs: int64 [num_runs, 3], disjoint rows.
        """
        if x.dtype != self.dtype or y.dtype != self.dtype:
            raise ValueError("LoRA operands must share one dtype")
        if x.shape[1] != self.in_features or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"LoRA inputs {tuple(x.shape)} and outputs {tuple(y.shape)} do not fit"
            )
        if not (x.is_contiguous() and y.is_contiguous()):
            raise ValueError("LoRA operands must be contiguous")
        args = self._args
        args.x, args.y, args.runs = x.data_ptr(), y.data_ptr(), runs.data_ptr()
        args.rows, args.num_runs, args.out_features = x.shape[0], runs.shape[0], y.shape[1]
        args.num_threads = torch.get_num_threads()
        check_status(_library().tm_lora(ctypes.byref(args)), self._what)


def add_lora_terms(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    runs: torch.Tensor,
    ranks: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: torch.Tensor,
) -> None:
    """y[first:end] += the term of the adapter in `slot`, for each (slot, first, end) run,
    in one call (`LoRATables` for what each argument holds)."""
    LoRATables(a, b, ranks, blocks, num_blocks).add(x, y, runs)
