"""FP8 (e4m3) weights as checkpoints store them, on the native fp8 kernel
(kernels/fp8_linear.py): the codes stay one byte each and are dequantized inside the
kernel, so memory stays at the checkpoint's size and the product is the one a dense fp32
model holding the dequantized weights computes (up to the order of its fp32 sums).

Formats decode their tensors with `fp8_weight` (which refuses NaN codes by name: the
kernel has no NaN), fused projections join with `concat_fp8`, and `Fp8Linear` runs a
layer - with compressed-tensors' dynamic per-token FP8 activations where the scheme asks
for them (`round_fp8_per_token`, the rounding compressed-tensors' forward applies).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.engine.kernels import fp8_linear as kernel
from tokenmill.engine.quant.checkpoint.weights import Fp8Weight

# The largest finite e4m3fn value: activations are scaled so their largest lands on it.
E4M3_MAX = 448.0
# e4m3fn's NaN codes (all exponent and mantissa bits set), either sign.
_NAN_BITS = 0x7F


def fp8_weight(
    name: str, weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> Fp8Weight:
    """A layer's e4m3 weight and its scales -> Fp8Weight.

    Args:
        name: the weight tensor's name, for errors.
        weight: float8_e4m3fn [n, k].
        scales: float, [ceil(n / bn), ceil(k / bk)] values in any shape of that many.
        block: (bn, bk).
    Raises:
        ValueError: a NaN code in the weight.
    """
    n, k = weight.shape
    codes = weight.contiguous().view(torch.uint8)
    if bool(((codes & _NAN_BITS) == _NAN_BITS).any()):
        raise ValueError(f"{name} holds NaN codes (0x7f/0xff), which no e4m3 weight takes")
    grid = (-(-n // block[0]), -(-k // block[1]))
    return Fp8Weight(codes, scales.float().reshape(grid).contiguous(), block)


def _per_channel(weight: Fp8Weight) -> Fp8Weight | None:
    """The weight with one scale per output row (a per-tensor weight's scale repeated),
    or None where its blocks span several inputs' scales."""
    n, k = weight.shape
    if weight.block[1] < k:
        return None
    if weight.block[0] == 1:
        return weight
    rows = torch.arange(n) // weight.block[0]
    return Fp8Weight(weight.codes, weight.scales[rows].contiguous(), (1, k))


def concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight | None:
    """Parts of one fused layer as one weight, rows one after another; None where their
    scale blocks do not line up (each part then runs on its own)."""
    k = parts[0].shape[1]
    block = parts[0].block
    if all(p.block == block for p in parts) and all(p.shape[0] % block[0] == 0 for p in parts[:-1]):
        codes = torch.cat([p.codes for p in parts])
        return Fp8Weight(codes, torch.cat([p.scales for p in parts]), block)
    # per-tensor parts (each its own scale), or blocks that end mid-part: a scale per row
    channels = [_per_channel(p) for p in parts]
    if any(c is None for c in channels):
        return None
    codes = torch.cat([c.codes for c in channels])
    return Fp8Weight(codes, torch.cat([c.scales for c in channels]), (1, k))


def round_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Each row of x rounded to e4m3 with its own scale max|row| / 448, and back: what
    compressed-tensors' forward does to a dynamic per-token FP8 input (in x's dtype, a
    zero row's scale its dtype's eps)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.to(x.dtype) * scale


class Fp8Linear(nn.Module):
    """y = x @ W^T + bias with W an Fp8Weight, dequantized inside the kernel.

    Args:
        weight: the codes and scales.
        bias: [n] or None.
        activations: None, or "fp8-token" - each input row rounded to FP8 first.
    """

    def __init__(
        self, weight: Fp8Weight, bias: torch.Tensor | None, activations: str | None = None
    ) -> None:
        super().__init__()
        if activations not in (None, "fp8-token"):
            raise ValueError(f"FP8 weights take fp8-token activations or none, not {activations}")
        self.out_features, self.in_features = weight.shape
        self.block = weight.block
        self.activations = activations
        self.register_buffer("codes", weight.codes.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.float().contiguous(), persistent=False)
        bias = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self.weight_bytes = self.codes.numel() + 4 * self.scales.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.activations == "fp8-token":
            rows = round_fp8_per_token(rows)
        y = kernel.fp8_linear(rows.contiguous(), self.codes, self.scales, self.block, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = ", fp8 activations per token" if self.activations else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fp8 e4m3 weights, scale blocks {self.block[0]}x{self.block[1]}{acts}"
        )


def describe_fp8_kernels(activations: str | None) -> str:
    """What runs an FP8 scheme's layers here, in words."""
    acts = "; activations rounded to fp8 per token" if activations else ""
    return f"{kernel.kernel_name()}, fp32 sums{acts}"
