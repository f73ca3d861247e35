"""What every checkpoint format's layers reduce to: integer codes with per-group scales
(IntWeight) or FP8 codes with block scales (Fp8Weight), and how one layer was quantized
(LayerScheme) - data only, no reading."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerScheme:
    """How one checkpoint layer's weights are stored and what its inputs go through.

    Attributes:
        format: the format in words, as `tokenmill models info` shows it
            ("compressed-tensors pack-quantized", "gptq v1", "awq gemm").
        bits: bits per weight.
        group_size: inputs that share a scale (the last group of a row may be shorter);
            None: one scale per output channel.
        symmetric: no zero points (the codes are centred on zero).
        activations: None - the inputs stay in the engine's float dtype (W4A16, W8A16);
            "int8-token" - each row of the input is quantized to int8 with its own scale
            at run time (compressed-tensors' dynamic per-token W8A8); "fp8-token" - each
            row rounded to FP8 (e4m3) with its own scale (FP8_DYNAMIC).
        act_order: GPTQ's desc_act: the inputs' groups are given column by column (g_idx).
        weight_type: "int" codes, or "fp8" (e4m3) codes.
        block: FP8 weights' scale blocks (outputs, inputs) where they are 2-D blocks.
    """

    format: str
    bits: int
    group_size: int | None
    symmetric: bool
    activations: str | None = None
    act_order: bool = False
    per_tensor: bool = False  # one scale (and zero point) for the whole weight
    weight_type: str = "int"
    block: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """The Hub's name for the scheme with its grouping: "W4A16 g128", "W8A8 per-channel",
        "FP8 W8A8 per-channel" (FP8_DYNAMIC), "FP8 W8A16 block 128x128"."""
        act = "8" if self.activations else "16"
        groups = f"g{self.group_size}" if self.group_size else "per-channel"
        groups = "per-tensor" if self.per_tensor else groups
        if self.block is not None:
            groups = f"block {self.block[0]}x{self.block[1]}"
        if self.weight_type == "fp8":
            return f"FP8 W8A{act} {groups}"
        extras = ("" if self.symmetric else ", zero points") + (
            ", act-order" if self.act_order else ""
        )
        return f"W{self.bits}A{act} {groups}{extras}"


@dataclass
class IntWeight:
    """One layer's quantized weight: value[o, i] = (q[o, i] - zero[o, g]) * scale[o, g]
    with g the group of input i.

    Attributes:
        q: int16 [n, k], the codes as integers (signed or not, as the format stores them).
        scale: [n, G] float (the checkpoint's dtype, never rounded).
        zero: int16 [n, G], or None where every zero point is 0.
        group_size: inputs per group in order (the last may be shorter); k for one group.
        g_idx: int64 [k], each input's group where the format gives them one by one
            (GPTQ's desc_act), else None.
        bits: the codes' width.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def input_groups(self) -> torch.Tensor:
        """int64 [k]: the group of each input."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Output rows [lo, hi) as fp32: (q - zero) * scale, each product rounded once (the
        difference of two integers is exact in fp32)."""
        hi = self.q.shape[0] if hi is None else hi
        groups = self.input_groups()
        codes = self.q[lo:hi].float()
        if self.zero is not None:
            codes -= self.zero[lo:hi].float()[:, groups]
        return codes.mul_(self.scale[lo:hi].float()[:, groups])


@dataclass
class Fp8Weight:
    """One layer's FP8 weight: value[o, i] = e4m3(codes[o, i]) * scales[o // bn, i // bk],
    one fp32 product each, with (bn, bk) = block.

    Attributes:
        codes: uint8 [n, k], e4m3fn bit patterns (never a NaN code).
        scales: fp32 [ceil(n / bn), ceil(k / bk)] (the checkpoint's values, widened exactly).
        block: the outputs and inputs one scale covers: (1, k) per channel, (n, k) per
            tensor, (128, 128) for DeepSeek's and Qwen's block-wise checkpoints.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32, each value its code's times its block's scale."""
        n, k = self.shape
        values = self.codes.view(torch.float8_e4m3fn).float()
        rows = torch.arange(n) // self.block[0]
        cols = torch.arange(k) // self.block[1]
        return values.mul_(self.scales[rows][:, cols])
