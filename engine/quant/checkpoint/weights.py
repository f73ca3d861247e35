"""What every checkpoint format's layers reduce to: integer codes with per-group scales
(IntWeight), and how one layer was quantized (LayerScheme) - data only, no reading."""

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
            at run time (compressed-tensors' dynamic per-token W8A8).
        act_order: GPTQ's desc_act: the inputs' groups are given column by column (g_idx).
    """

    format: str
    bits: int
    group_size: int | None
    symmetric: bool
    activations: str | None = None
    act_order: bool = False
    per_tensor: bool = False  # one scale (and zero point) for the whole weight

    @property
    def label(self) -> str:
        """The Hub's name for the scheme with its grouping: "W4A16 g128", "W8A8 per-channel"."""
        act = "8" if self.activations else "16"
        groups = f"g{self.group_size}" if self.group_size else "per-channel"
        groups = "per-tensor" if self.per_tensor else groups
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
