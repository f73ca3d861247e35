"""MXFP4, the OCP Microscaling format gpt-oss's experts ship in: each block of 32 values
along a row's inputs shares one power-of-two scale (e8m0: a biased exponent byte,
2^(e - 127)), and each value is a 4-bit e2m1 float (sign, two exponent bits, one
mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives).

A checkpoint stores a stacked projection `<name>` ([experts, out, in] as a linear's
weights) as two uint8 tensors, the layout of transformers' gpt-oss MXFP4 integration:

    <name>_blocks [experts, out, in / 32, 16]  two codes a byte, the even input in the
                                              low nibble
    <name>_scales [experts, out, in / 32]      the block's e8m0 exponent

`quantize` is the packer test checkpoints are written with (the spec's recipe: the
block's scale is 2^(floor(log2(max |v|)) - 2), 2 being e2m1's largest exponent, and each
value rounds to the nearest e2m1, ties to even, clamped to +-6); `dequantize` reads the
format back in float (the reference: the kernel reads it as stored, kernels/moe.py).
"""

from __future__ import annotations

import torch

from tokenmill.engine.kernels.moe import E2M1_VALUES

BLOCK = 32  # values sharing one scale
_E2M1_EMAX = 2  # the largest e2m1 exponent (6 = 1.5 * 2^2)
_E8M0_BIAS = 127


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (blocks uint8 [..., out, in / 32, 16], scales uint8
    [..., out, in / 32]).

    Raises:
        ValueError: `in` not a whole number of blocks.
    """
    *lead, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs rows of whole blocks of {BLOCK} values, not {k}")
    groups = w.float().reshape(*lead, n, k // BLOCK, BLOCK)
    largest = groups.abs().amax(dim=-1)
    # A block of zeros takes the smallest scale; its codes are all 0.
    exponent = torch.where(
        largest > 0, torch.floor(torch.log2(largest)) - _E2M1_EMAX, torch.full_like(largest, -127)
    ).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = _nearest_e2m1(scaled)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + _E8M0_BIAS).to(torch.uint8)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code nearest each value, clamped to +-6; a value halfway between two
    takes the one whose mantissa bit is 0 (round half to even)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    distance = (x.abs().clamp(max=6.0)[..., None] - magnitudes).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even = torch.tensor([2, 1, 2, 1, 2, 1, 2, 1], dtype=torch.uint8)  # codes 0, 2, ... first
    index = torch.argmax(nearest.to(torch.uint8) * even, dim=-1).to(torch.uint8)
    return index | ((x < 0).to(torch.uint8) << 3)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks [..., out, in / 32, 16], scales [..., out, in / 32]) -> fp32 [..., out, in]."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES)[codes]
    exponent = scales.to(torch.int32) - _E8M0_BIAS
    out = torch.ldexp(values, exponent[..., None].float())
    return out.flatten(-2)
