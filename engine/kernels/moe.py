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
# int4: k-rows per group sharing a scale and a minimum, and the readable columns after
# each row (the kernel reads 16 columns at a time unmasked).
INT4_GROUP = 32
MXFP4_BLOCK = 32  # MXFP4: inputs sharing one e8m0 scale
_INT4_PAD_COLS = 32
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
# Readable columns after each bf16 projection: AMX tiles read whole 64-column bands.
_BF16_PAD_COLS = 64


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


def _k_major(w: torch.Tensor, pad: int) -> torch.Tensor:
    """[E, n, k] (a linear's weights per expert) -> [E, k, n + pad], zeros in the pad."""
    num, n, k = w.shape
    out = torch.zeros(num, k, n + pad, dtype=w.dtype)
    out[:, :, :n] = w.transpose(1, 2)
    return out


def _pairs(w: torch.Tensor) -> torch.Tensor:
    """[E, k, n] -> [E, k / 2, n, 2]: rows 2i and 2i + 1 side by side, as vdpbf16ps takes
    them."""
    num, k, n = w.shape
    return w.view(num, k // 2, 2, n).transpose(2, 3).contiguous()


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


def _mxfp4_k_major(
    blocks: torch.Tensor, scales: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as stored ([E, n, k / 32, 16] codes two inputs a byte, [E, n, k / 32] e8m0)
    -> moe.c's layout: codes two columns a byte, k-major ([E, k, (n + pad) / 2]), and
    scales [E, k / 32, n + pad] (the pad's codes 0, its scales 2^0). One expert at a time,
    so only one expert's codes are ever held a byte each."""
    num, n, groups, _ = blocks.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}, {scales.dtype}")
    if tuple(scales.shape) != (num, n, groups) or blocks.shape[3] != INT4_GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    k = groups * INT4_GROUP
    nibbles = torch.empty(num, k, (n + pad) // 2, dtype=torch.uint8)
    for e in range(num):
        codes = torch.zeros(k, n + pad, dtype=torch.uint8)
        pairs = blocks[e]  # [n, k / 32, 16]
        codes[:, :n] = torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(n, k).T
        nibbles[e] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    padded_scales = torch.full((num, groups, n + pad), 127, dtype=torch.uint8)
    padded_scales[:, :, :n] = scales.transpose(1, 2)
    return nibbles, padded_scales


def _mxfp4_weights(nibbles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """moe.c's MXFP4 layout -> fp32 [E, n, k] (the reference for tests)."""
    codes = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(-2)[..., :n].long()
    exponent = scales[..., :n].to(torch.int32).repeat_interleave(INT4_GROUP, dim=1) - 127
    return torch.ldexp(torch.tensor(E2M1_VALUES)[codes], exponent.float()).transpose(1, 2)


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
    for n, k in ((2 * inter, hidden), (hidden, inter)):  # gate_up, down: [E, n, k]
        if weight_format == "float":
            pad = _BF16_PAD_COLS if dtype == torch.bfloat16 else 0
            total += num_experts * k * (n + pad) * dtype.itemsize
        elif weight_format == "int8":
            total += num_experts * (k * n + 4 * n)  # the codes, an fp32 scale per column
        elif weight_format == "int4":
            cols = n + _INT4_PAD_COLS  # nibbles, and a bf16 scale and minimum per group
            total += num_experts * (k * cols // 2 + (k // INT4_GROUP) * 2 * cols * 2)
        elif weight_format == "mxfp4":
            cols = n + _INT4_PAD_COLS  # nibbles, and an e8m0 byte per block of 32
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
        is_bf16 = self.dtype == torch.bfloat16
        self.gate_up_scales = self.down_scales = None
        if weight_format == "int8":
            self.pad_cols = 0
            gate_up_q, self.gate_up_scales = quantize_int8(gate_up)
            down_q, self.down_scales = quantize_int8(down)
            self.gate_up, self.down = _k_major(gate_up_q, 0), _k_major(down_q, 0)
            return
        if weight_format == "int4":
            self.pad_cols = _INT4_PAD_COLS
            self.gate_up, self.gate_up_scales = self._int4(gate_up)
            self.down, self.down_scales = self._int4(down)
            return
        if weight_format != "float":
            raise ValueError(f"unknown expert weight format {weight_format!r}")
        self.pad_cols = _BF16_PAD_COLS if is_bf16 else 0
        gate_up_t, down_t = _k_major(gate_up, self.pad_cols), _k_major(down, self.pad_cols)
        self.gate_up = _pairs(gate_up_t) if is_bf16 else gate_up_t
        self.down = _pairs(down_t) if is_bf16 else down_t

    def _int4(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, n, k] -> (nibbles uint8 [E, k, (n + pad) / 2], groups bf16 [E, k / 32, 2,
        n + pad]), moe.c's int4 layout."""
        num, n, k = w.shape
        if k % INT4_GROUP or n % 2:
            raise ValueError(
                f"int4 experts need sizes that are multiples of {INT4_GROUP}: {n} x {k}"
            )
        q, scale, minimum = quantize_int4(w)
        q = _k_major(q, self.pad_cols)  # [E, k, n + pad], zeros in the pad
        nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
        groups = torch.zeros(num, k // INT4_GROUP, 2, n + self.pad_cols, dtype=torch.bfloat16)
        groups[:, :, 0, :n] = scale.transpose(1, 2)
        groups[:, :, 1, :n] = minimum.transpose(1, 2)
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
        self.weight_format, self.pad_cols = "mxfp4", _INT4_PAD_COLS
        self.gate_up, self.gate_up_scales = _mxfp4_k_major(*gate_up, self.pad_cols)
        self.down, self.down_scales = _mxfp4_k_major(*down, self.pad_cols)
        if self.down.shape[1] != self.inter or self.down_scales.shape[2] != self.hidden + 32:
            raise ValueError(
                f"MXFP4 down_proj of {self.down.shape[1]} inputs and "
                f"{self.down_scales.shape[2] - 32} outputs does not fit gate_up's "
                f"{self.hidden} x {self.inter}"
            )
        return self

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized experts' weights as the kernel reads them, fp32 in transformers'
        layout ([E, 2 * inter, hidden], [E, hidden, inter]): the reference for tests."""
        if self.weight_format == "mxfp4":
            return (
                _mxfp4_weights(self.gate_up, self.gate_up_scales, 2 * self.inter),
                _mxfp4_weights(self.down, self.down_scales, self.hidden),
            )
        if self.weight_format == "int4":
            return (
                self._int4_weights(self.gate_up, self.gate_up_scales, 2 * self.inter),
                self._int4_weights(self.down, self.down_scales, self.hidden),
            )
        gate_up = self.gate_up.transpose(1, 2).float() * self.gate_up_scales[..., None]
        down = self.down.transpose(1, 2).float() * self.down_scales[..., None]
        return gate_up, down

    @staticmethod
    def _int4_weights(nibbles: torch.Tensor, groups: torch.Tensor, n: int) -> torch.Tensor:
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(-2)[..., :n].float()
        scale = groups[:, :, 0, :n].float().repeat_interleave(INT4_GROUP, dim=1)
        minimum = groups[:, :, 1, :n].float().repeat_interleave(INT4_GROUP, dim=1)
        return (q * scale + minimum).transpose(1, 2)

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
            pad_cols=self.pad_cols,
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
