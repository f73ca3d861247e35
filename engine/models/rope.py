"""Rotary position embeddings: each rope scaling's inverse frequencies, and the cos/sin a
step looks up.

Every scaling is computed as transformers computes it (`modeling_rope_utils`), in the same
fp32 operations, so the tables agree with its to the bit: `linear`, `llama3`, `dynamic`
(NTK), `yarn` (with its attention factor) and `longrope` (short and long factors).

Two of them choose their frequencies from the sequence's length. `dynamic` raises the base
once a sequence outgrows max_position_embeddings; `longrope` uses its long factors once it
outgrows original_max_position_embeddings. transformers recomputes them on every forward
from the longest position it is given; the engine keeps keys from one step to the next, so
it fixes them per sequence from the longest the sequence can become (its prompt plus
max_tokens, within the context) - what one forward over the whole sequence computes. That
choice is the sequence's rope variant (`Rope.variant_for_length`: 0 for the frequencies of
short sequences); it keys the prefix cache, so keys computed under one variant are never
served to a sequence under another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.engine.kernels import elementwise


@dataclass(frozen=True)
class Rope:
    """One model's rotary embedding.

    Args:
        dim: rotated dimensions per head (head_dim, or its partial_rotary_factor share).
        theta: the rotary base.
        scaling: a ModelConfig.rope_scaling dict (config.rope_scaling_of: its kind under
            "rope_type", defaults resolved), or None for plain rope.
    """

    dim: int
    theta: float
    scaling: dict | None = None

    @property
    def kind(self) -> str:
        return "default" if self.scaling is None else self.scaling["rope_type"]

    @property
    def depends_on_length(self) -> bool:
        """Whether a sequence's frequencies depend on its length (dynamic, longrope)."""
        return self.kind in ("dynamic", "longrope")

    def variant_for_length(self, length: int) -> int:
        """The frequencies a sequence of at most `length` tokens runs with: 0 = those of
        short sequences; for dynamic the length itself past the original context, for
        longrope 1 (the long factors) past it."""
        if not self.depends_on_length or length <= self.scaling["original_max_position_embeddings"]:
            return 0
        return length if self.kind == "dynamic" else 1

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's and longrope's; 1 otherwise)."""
        return float((self.scaling or {}).get("attention_factor", 1.0))

    def inv_freq(self, variant: int = 0) -> torch.Tensor:
        """Inverse frequencies [dim // 2], fp32, for a variant (`variant_for_length`)."""
        scaling = self.scaling or {}
        kind = self.kind
        if kind == "dynamic":
            return _dynamic_inv_freq(self.dim, self.theta, scaling, variant or None)
        if kind == "longrope":
            factors = scaling["long_factor" if variant else "short_factor"]
            shape = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta**shape)
        if kind == "yarn":
            return _yarn_inv_freq(self.dim, self.theta, scaling)
        inv_freq = _default_inv_freq(self.dim, self.theta)
        if kind == "linear":
            return inv_freq / scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        return inv_freq

    def tables(
        self, positions: torch.Tensor, variant: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), dim] for these positions under a variant: full-width,
        the sine signed for the halves-swapped input, so rotating is two multiplies and
        an add: x * cos + swap_halves(x) * sin."""
        freqs = torch.outer(positions.float(), self.inv_freq(variant).to(positions.device))
        cos, sin = freqs.cos(), freqs.sin()
        factor = self.attention_factor
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if factor != 1.0:  # transformers scales cos and sin after the cat, as here
            cos, sin = cos * factor, sin * factor
        return cos, sin


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_factor
    high_freq_wavelen = old_context / high_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(dim: int, theta: float, scaling: dict, length: int | None) -> torch.Tensor:
    """NTK-scaled frequencies for a sequence of `length` tokens past the original context
    (None: within it), in transformers' arithmetic: Python floats for the frequencies it
    starts with, an fp32 tensor base for those it recomputes from a longer sequence."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    seq_len = original if length is None else torch.tensor(max(length, original))
    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share


def yarn_attention_factor(
    factor: float, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """YaRN's default attention factor (transformers' `yarn_get_mscale` ratio)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's default attention factor."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """Cos/sin tables of the short-sequence frequencies, precomputed, looked up once per
    step for all layers; rows of sequences under another variant computed in the step."""

    def __init__(self, rope: Rope, max_positions: int, device: torch.device) -> None:
        self.rope = rope
        positions = torch.arange(max_positions, device=device)
        self.cos, self.sin = rope.tables(positions)  # [max_positions, dim]

    def lookup(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        variants: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [num_tokens, 1, dim], broadcast over heads.

        Args:
            positions: [num_tokens]
            variants: [num_tokens] each token's sequence's rope variant, or None for all 0.
        """
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        if variants is not None:
            for variant in variants.unique().tolist():
                if variant:
                    rows = (variants == variant).nonzero().squeeze(1)
                    cos[rows], sin[rows] = self.rope.tables(positions[rows], variant)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the HF layout): x: [num_tokens, num_heads, dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary on q and k; v passes through (made contiguous on the fused path). Where the
    tables are narrower than a head (partial rotary: Phi-3, Phi-4-mini) only the leading
    dimensions rotate, as transformers' Phi-3 does; the rest pass unchanged.

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim],
            views into the qkv projection's output or tensors of their own
        cos, sin: [num_tokens, 1, rotary_dim] (RotaryEmbedding.lookup)
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q, k = q.clone(), k.clone()
        q[..., :rotary_dim] = apply_rotary(q[..., :rotary_dim], cos, sin)
        k[..., :rotary_dim] = apply_rotary(k[..., :rotary_dim], cos, sin)
        return q, k, v
    if elementwise.rotary_supports(q, k, v, cos):
        return elementwise.rotary_qkv(q, k, v, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
