"""Python side of moe.c: a mixture-of-experts layer's experts - every (token, expert)
pair of a step - in one native call per layer (engine/models/moe.py routes the tokens and
holds the weights; `PackedExperts` keeps them in the layout the kernel reads)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import MoEArgs, check_status

DTYPES = (torch.float32, torch.bfloat16)
# kernels.h TM_MOE_*: how the experts' weights are stored, by name.
WEIGHT_FORMATS = {"float": 0, "int8": 1, "int4": 2, "mxfp4": 3}
# int4: k-rows per group sharing a scale and a minimum.
INT4_GROUP = 32
MXFP4_BLOCK = 32  # MXFP4: inputs sharing one e8m0 scale
# Output columns per panel (kernels.h TM_MOE_PANEL_COLS): each projection's columns are
# stored in panels of 64, each panel's k-rows one contiguous block, so that one work item
# of the kernel streams one block of memory (a k-major row of all columns put the next
# k-row of an item a page away, and the hardware prefetchers do not cross pages). A
# gate_up panel holds 32 gate columns then the same 32 up ones; a down panel 64 hidden
# columns. Pads are zero weights, their outputs computed and dropped.
PANEL_COLS = 64
_HALF_PANEL = PANEL_COLS // 2
# MXFP4's e2m1 codes 0..15 -> their values (sign bit, 2 exponent bits, 1 mantissa bit),
# as moe.c's E2M1 table.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# kernels.h TM_GATED_*: the gated activations tm_moe computes, by their HF config name
# (gpt-oss's clamped SwiGLU by ours: it has none).
ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2, "clamped_swiglu": 3}


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library()
    return None if native is None else native.lib


def available(
    dtype: torch.dtype, device: torch.device, hidden: int, inter: int, top_k: int
) -> bool:
    """Whether the native call serves experts of this dtype, device and shape (bf16 pairs
    its k, so needs even sizes)."""
    if device.type != "cpu" or dtype not in DTYPES or _library() is None:
        return False
    if top_k > native_library().limits.moe_max_top_k:
        return False
    return dtype != torch.bfloat16 or (hidden % 2 == 0 and inter % 2 == 0)


def isa() -> str | None:
    """How tm_moe computes here (interface.MOE_ISAS), or None without the library."""
    native = native_library()
    return None if native is None else native.limits.moe_isa


def panel_count(n: int, gated: bool) -> int:
    """Panels of a projection of n output columns (gated: gate_up's, 2 * inter)."""
    return -(-(n // 2) // _HALF_PANEL) if gated else -(-n // PANEL_COLS)


def _panels(w: torch.Tensor, gated: bool, fill: float = 0) -> torch.Tensor:
    """One expert's [n, *rest] (a value per output column) -> [P, 64, *rest]: the columns
    dealt into panels (gated: panel j holds gate columns 32j.. then up columns 32j..), the
    pads `fill`."""
    n, rest = w.shape[0], w.shape[1:]
    count = panel_count(n, gated)
    out = torch.full((count, PANEL_COLS, *rest), fill, dtype=w.dtype)
    if not gated:
        out.view(count * PANEL_COLS, *rest)[:n] = w
        return out
    halves = out.view(count, 2, _HALF_PANEL, *rest)
    inter = n // 2
    for half, columns in enumerate((w[:inter], w[inter:])):
        spread = torch.full((count * _HALF_PANEL, *rest), fill, dtype=w.dtype)
        spread[:inter] = columns
        halves[:, half] = spread.view(count, _HALF_PANEL, *rest)
    return out


def _unpanel(t: torch.Tensor, n: int, gated: bool) -> torch.Tensor:
    """[E, P, 64, *rest] -> [E, n, *rest], `_panels`' inverse over every expert."""
    num, count, rest = t.shape[0], t.shape[1], t.shape[3:]
    if not gated:
        return t.reshape(num, count * PANEL_COLS, *rest)[:, :n]
    halves = t.reshape(num, count, 2, _HALF_PANEL, *rest)
    gate, up = (
        halves[:, :, h].reshape(num, count * _HALF_PANEL, *rest)[:, : n // 2] for h in (0, 1)
    )
    return torch.cat((gate, up), dim=1)


def _k_major_panels(w: torch.Tensor, gated: bool, fill: float = 0) -> torch.Tensor:
    """[E, n, k] -> [E, P, k, 64]: each panel's k-rows of 64 columns, `fill` in the pads
    (an expert at a time: one expert's temporaries beside the result)."""
    num, n, k = w.shape
    out = torch.empty(num, panel_count(n, gated), k, PANEL_COLS, dtype=w.dtype)
    for e in range(num):
        out[e] = _panels(w[e], gated, fill).transpose(1, 2)
    return out


def _pairs(w: torch.Tensor) -> torch.Tensor:
    """[E, P, k, 64] -> [E, P, k / 2, 64, 2]: rows 2i and 2i + 1 side by side, as
    vdpbf16ps and AMX tiles take them."""
    num, count, k, cols = w.shape
    return w.view(num, count, k // 2, 2, cols).transpose(3, 4).contiguous()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., 64] -> [..., 32]: two columns a byte, the even one low."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _codes(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(-2)


# Experts quantized at a time: their fp32 temporaries stay small beside the layer's
# stack (a whole OLMoE stack in fp32 is a gigabyte, and three such temporaries live at
# once); each row is quantized on its own, so the chunking changes no value.
_EXPERTS_PER_CHUNK = 4


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, n, k] float -> (int8 [E, n, k], fp32 scales [E, n]): each output row
    symmetric, its largest magnitude at 127; w ~ q * scale."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[:2], dtype=torch.float32)
    for start in range(0, w.shape[0], _EXPERTS_PER_CHUNK):
        part = w[start : start + _EXPERTS_PER_CHUNK].float()
        part_scales = part.abs().amax(dim=-1).clamp(min=1e-12) / 127
        stop = start + part.shape[0]
        q[start:stop] = torch.round(part / part_scales[..., None]).clamp_(-127, 127)
        scales[start:stop] = part_scales
    return q, scales


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, n, k] float -> (q uint8 [E, n, k] in 0..15, scale, minimum: bf16 [E, n, k / 32]):
    each group of 32 inputs of an output row spans its range in 16 steps (GGUF's Q4_1
    recipe); w ~ q * scale + minimum, with the bf16 scale and minimum the kernel reads."""
    num, n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.uint8)
    scale = torch.empty(num, n, k // INT4_GROUP, dtype=torch.bfloat16)
    minimum = torch.empty_like(scale)
    for start in range(0, num, _EXPERTS_PER_CHUNK):
        part = w[start : start + _EXPERTS_PER_CHUNK]
        stop = start + part.shape[0]
        groups = part.float().reshape(stop - start, n, k // INT4_GROUP, INT4_GROUP)
        part_min = groups.amin(dim=-1).to(torch.bfloat16)
        span = groups.amax(dim=-1) - part_min.float()
        part_scale = torch.where(span > 0, span / 15, torch.ones_like(span)).to(torch.bfloat16)
        codes = torch.round((groups - part_min.float()[..., None]) / part_scale.float()[..., None])
        q[start:stop] = codes.clamp_(0, 15).reshape(stop - start, n, k)
        scale[start:stop], minimum[start:stop] = part_scale, part_min
    return q, scale, minimum


def _mxfp4_panels(
    blocks: torch.Tensor, scales: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as stored ([E, n, k / 32, 16] codes two inputs a byte, [E, n, k / 32] e8m0)
    -> moe.c's layout: codes two columns a byte in k-major panels ([E, P, k, 32]), and
    scales [E, P, k / 32, 64] (the pads' codes 0, their scales 2^0). One expert at a time,
    so only one expert's codes are ever held a byte each."""
    num, n, groups, _ = blocks.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}, {scales.dtype}")
    if tuple(scales.shape) != (num, n, groups) or blocks.shape[3] != INT4_GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    k, count = groups * INT4_GROUP, panel_count(n, gated)
    nibbles = torch.empty(num, count, k, _HALF_PANEL, dtype=torch.uint8)
    padded_scales = torch.empty(num, count, groups, PANEL_COLS, dtype=torch.uint8)
    for e in range(num):
        codes = _codes(blocks[e]).reshape(n, k)  # [n, k / 32, 16] -> [n, k]
        nibbles[e] = _nibbles(_panels(codes, gated).transpose(1, 2))
        padded_scales[e] = _panels(scales[e], gated, fill=127).transpose(1, 2)
    return nibbles, padded_scales


def _mxfp4_weights(
    nibbles: torch.Tensor, scales: torch.Tensor, n: int, gated: bool
) -> torch.Tensor:
    """moe.c's MXFP4 layout -> fp32 [E, n, k] (the reference for tests)."""
    codes = _codes(nibbles).long()  # [E, P, k, 64]
    exponent = scales.to(torch.int32).repeat_interleave(INT4_GROUP, dim=2) - 127
    values = torch.ldexp(torch.tensor(E2M1_VALUES)[codes], exponent.float())
    return _unpanel(values.transpose(2, 3), n, gated)


def _fp32_or_none(bias: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    if bias is None:
        return None
    if tuple(bias.shape) != shape:
        raise ValueError(f"expert bias of shape {tuple(bias.shape)}, expected {shape}")
    return bias.detach().float().contiguous()


def packed_bytes(
    num_experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    weight_format: str,
    *,
    biases: bool = False,
) -> int:
    """What `PackedExperts` of experts this size take in `weight_format` ("float",
    "int8", "int4", "mxfp4": `from_mxfp4`'s), computed from its layout without packing
    anything: the memory plan's count of a layer's experts as the load leaves them.
    `biases`: with a bias per expert on each projection (kept in fp32)."""
    total = 4 * num_experts * (2 * inter + hidden) if biases else 0
    for n, k, gated in ((2 * inter, hidden, True), (hidden, inter, False)):
        cols = panel_count(n, gated) * PANEL_COLS  # whole panels, pads included
        if weight_format == "float":
            total += num_experts * k * cols * dtype.itemsize
        elif weight_format == "int8":
            total += num_experts * (k * cols + 4 * cols)  # the codes, an fp32 scale per column
        elif weight_format == "int4":  # nibbles, and a bf16 scale and minimum per group
            total += num_experts * (k * cols // 2 + (k // INT4_GROUP) * 2 * cols * 2)
        elif weight_format == "mxfp4":  # nibbles, and an e8m0 byte per block of 32
            total += num_experts * (k * cols // 2 + (k // MXFP4_BLOCK) * cols)
        else:
            raise ValueError(f"unknown expert weight format {weight_format!r}")
    return total


class PackedExperts:
    """A layer's experts in tm_moe's layout (moe.c), packed once.

    Args:
        gate_up: [num_experts, 2 * inter, hidden], the gate rows first (transformers' layout).
        down: [num_experts, hidden, inter].
        activation: the gate's activation, by its HF name (ACTIVATIONS); "clamped_swiglu"
            takes `swiglu` = (alpha, limit).
        gate_up_bias: [num_experts, 2 * inter] (the gate's first), down_bias: [num_experts,
            hidden]: each projection's bias per expert (gpt-oss), or None.
        weight_format: "float" (the weights' dtype, which is also the activations'),
            "int8" (each output column quantized with its own scale: `quantize_int8`) or
            "int4" (groups of 32 inputs: `quantize_int4`; hidden and intermediate sizes
            multiples of 32); quantized, the activations stay in the weights' given dtype.
    """

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        activation: str,
        weight_format: str = "float",
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        swiglu: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.dtype = gate_up.dtype
        self.num_experts, two_inter, self.hidden = gate_up.shape
        self.inter = two_inter // 2
        self.activation = ACTIVATIONS[activation]
        self.swiglu = swiglu
        self.gate_up_bias = _fp32_or_none(gate_up_bias, (self.num_experts, two_inter))
        self.down_bias = _fp32_or_none(down_bias, (self.num_experts, self.hidden))
        self.weight_format = weight_format
        self.gate_up_scales = self.down_scales = None
        if weight_format == "int8":
            gate_up_q, gate_up_scales = quantize_int8(gate_up)
            self.gate_up = _k_major_panels(gate_up_q, gated=True)
            self.gate_up_scales = _k_major_panels(gate_up_scales[..., None], gated=True, fill=1)
            del gate_up_q
            down_q, down_scales = quantize_int8(down)
            self.down = _k_major_panels(down_q, gated=False)
            self.down_scales = _k_major_panels(down_scales[..., None], gated=False, fill=1)
            self.gate_up_scales, self.down_scales = (
                t.reshape(self.num_experts, -1) for t in (self.gate_up_scales, self.down_scales)
            )
            return
        if weight_format == "int4":
            self.gate_up, self.gate_up_scales = self._int4(gate_up, gated=True)
            self.down, self.down_scales = self._int4(down, gated=False)
            return
        if weight_format != "float":
            raise ValueError(f"unknown expert weight format {weight_format!r}")
        self.gate_up = _k_major_panels(gate_up, gated=True)
        self.down = _k_major_panels(down, gated=False)
        if self.dtype == torch.bfloat16:
            self.gate_up, self.down = _pairs(self.gate_up), _pairs(self.down)

    @staticmethod
    def _int4(w: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, n, k] -> (nibbles uint8 [E, P, k, 32], groups bf16 [E, P, k / 32, 2, 64]),
        moe.c's int4 layout."""
        num, n, k = w.shape
        if k % INT4_GROUP:
            raise ValueError(
                f"int4 experts need sizes that are multiples of {INT4_GROUP}: {n} x {k}"
            )
        q, scale, minimum = quantize_int4(w)
        nibbles = _nibbles(_k_major_panels(q, gated))
        del q
        groups = torch.stack(
            (_k_major_panels(scale, gated), _k_major_panels(minimum, gated)), dim=3
        )
        return nibbles, groups

    @classmethod
    def from_mxfp4(
        cls,
        gate_up: tuple[torch.Tensor, torch.Tensor],
        down: tuple[torch.Tensor, torch.Tensor],
        dtype: torch.dtype,
        activation: str,
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        swiglu: tuple[float, float] = (0.0, 0.0),
    ) -> PackedExperts:
        """Experts stored in MXFP4 (quant/mxfp4.py: (blocks, scales) per projection, the
        gate rows first), repacked into moe.c's k-major nibbles without widening them: 4
        bits a weight and a byte per 32, as stored. Activations run in `dtype`."""
        self = cls.__new__(cls)
        self.dtype = dtype
        blocks, _ = gate_up
        self.num_experts, two_inter, groups, _ = blocks.shape
        self.hidden, self.inter = groups * INT4_GROUP, two_inter // 2
        self.activation = ACTIVATIONS[activation]
        self.swiglu = swiglu
        self.gate_up_bias = _fp32_or_none(gate_up_bias, (self.num_experts, two_inter))
        self.down_bias = _fp32_or_none(down_bias, (self.num_experts, self.hidden))
        self.weight_format = "mxfp4"
        down_outputs, down_groups = down[0].shape[1:3]
        if down_groups * INT4_GROUP != self.inter or down_outputs != self.hidden:
            raise ValueError(
                f"MXFP4 down_proj of {down_groups * INT4_GROUP} inputs and {down_outputs} "
                f"outputs does not fit gate_up's {self.hidden} x {self.inter}"
            )
        self.gate_up, self.gate_up_scales = _mxfp4_panels(*gate_up, gated=True)
        self.down, self.down_scales = _mxfp4_panels(*down, gated=False)
        return self

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized experts' weights as the kernel reads them, fp32 in transformers'
        layout ([E, 2 * inter, hidden], [E, hidden, inter]): the reference for tests."""
        projections = (
            (self.gate_up, self.gate_up_scales, 2 * self.inter, True),
            (self.down, self.down_scales, self.hidden, False),
        )
        if self.weight_format == "mxfp4":
            return tuple(_mxfp4_weights(*p) for p in projections)
        if self.weight_format == "int4":
            return tuple(self._int4_weights(*p) for p in projections)
        if self.weight_format != "int8":
            raise ValueError(f"{self.weight_format} experts are not quantized")
        return tuple(
            _unpanel(
                (q.float() * scales.view(*q.shape[:2], 1, PANEL_COLS)).transpose(2, 3), n, gated
            )
            for q, scales, n, gated in projections
        )

    @staticmethod
    def _int4_weights(
        nibbles: torch.Tensor, groups: torch.Tensor, n: int, gated: bool
    ) -> torch.Tensor:
        q = _codes(nibbles).float()  # [E, P, k, 64]
        scale = groups[:, :, :, 0].float().repeat_interleave(INT4_GROUP, dim=2)
        minimum = groups[:, :, :, 1].float().repeat_interleave(INT4_GROUP, dim=2)
        return _unpanel((q * scale + minimum).transpose(2, 3), n, gated)

    @property
    def weight_bytes(self) -> int:
        tensors = (
            self.gate_up,
            self.down,
            self.gate_up_scales,
            self.down_scales,
            self.gate_up_bias,
            self.down_bias,
        )
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """x: [rows, hidden]; expert_ids int64 and expert_weights fp32: [rows, top_k] ->
        [rows, hidden], x's dtype."""
        if x.dtype != self.dtype or x.shape[-1] != self.hidden:
            raise ValueError(
                f"experts over {self.hidden} {self.dtype} values got {tuple(x.shape)} {x.dtype}"
            )
        x = x.contiguous()
        expert_ids = expert_ids.to(torch.int64).contiguous()
        expert_weights = expert_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        args = MoEArgs(
            x=x.data_ptr(),
            expert_ids=expert_ids.data_ptr(),
            expert_weights=expert_weights.data_ptr(),
            gate_up=self.gate_up.data_ptr(),
            down=self.down.data_ptr(),
            gate_up_scales=None if self.gate_up_scales is None else self.gate_up_scales.data_ptr(),
            down_scales=None if self.down_scales is None else self.down_scales.data_ptr(),
            gate_up_bias=None if self.gate_up_bias is None else self.gate_up_bias.data_ptr(),
            down_bias=None if self.down_bias is None else self.down_bias.data_ptr(),
            out=out.data_ptr(),
            rows=x.shape[0],
            top_k=expert_ids.shape[1],
            num_experts=self.num_experts,
            hidden=self.hidden,
            inter=self.inter,
            panel_cols=PANEL_COLS,
            is_bf16=int(self.dtype == torch.bfloat16),
            weight_format=WEIGHT_FORMATS[self.weight_format],
            activation=self.activation,
            swiglu_alpha=self.swiglu[0],
            swiglu_limit=self.swiglu[1],
            num_threads=torch.get_num_threads(),
        )
        what = f"{self.num_experts} experts of {self.hidden} x {self.inter}"
        check_status(_library().tm_moe(ctypes.byref(args)), what)
        return out
