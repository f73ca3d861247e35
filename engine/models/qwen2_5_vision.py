"""Qwen2.5-VL's vision tower (and Qwen2-VL's, its predecessor), batched over many images
of different sizes per call.

The images of a call are one flat sequence of patches (as the processor flattens them,
loader/qwen_images.py) with each image's grid (frames, rows, columns); no image is padded.
As transformers computes it:
- the patch embedding is a 3D convolution whose stride equals its kernel, so over one
  flattened patch it is a plain matrix product (the weight kept in the checkpoint's
  [hidden, channels, frames, py, px] shape, read as [hidden, channels * frames * py * px]);
- 2D rotary attention: a patch's row index rotates the first half of each head's
  rotary frequencies, its column index the second half;
- window attention: the merged tokens of an image are tiled into windows of
  `window_size` pixels a side, and every block attends within a window but those of
  `fullatt_block_indexes`, which attend across the whole image. The patches are put in
  window order once (whole merge groups move together) and back at the end;
- pre-RMSNorm blocks with a SwiGLU MLP (biases on every projection);
- the patch merger: RMSNorm, then each merge_size x merge_size group of patches
  concatenated into one vector and mapped by a GELU MLP to the text model's width.

Qwen2-VL's tower is the same but for three things: LayerNorms where Qwen2.5-VL has
RMSNorms, an fc1 -> quick-GELU -> fc2 MLP, and no windows (every block attends across
the whole image) - the config's `layer_norm`, `gated_mlp` and `window_size` None.

Attention runs over variable-length segments (an image, or a window) without padding:
segments of equal length - most windows of an image, images of equal size - are
gathered into one batched scaled-dot-product call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class QwenVisionConfig:
    """transformers' Qwen2_5_VLVisionConfig, the fields the tower reads."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int | None = 112  # None: no windows (Qwen2-VL)
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = field(default=(7, 15, 23, 31))
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6  # fixed in transformers' tower, not a config field
    layer_norm: bool = False  # LayerNorm (with bias) in place of RMSNorm: Qwen2-VL
    gated_mlp: bool = True  # SwiGLU; else fc1 -> quick GELU -> fc2 (Qwen2-VL)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches folded into one token by the merger."""
        return self.spatial_merge_size**2

    @property
    def window_tokens(self) -> int | None:
        """A window's side, in merged tokens (None: no windows)."""
        if self.window_size is None:
            return None
        return self.window_size // self.spatial_merge_size // self.patch_size


class RMSNorm(nn.Module):
    """transformers' Qwen2 RMSNorm: normalised in fp32, scaled by `weight` after the cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = x.float()
        values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * values.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(
            torch.empty(config.hidden_size, config.in_channels, t, p, p)
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[num_patches, channels * frames * py * px] -> [num_patches, hidden]."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


@dataclass(frozen=True)
class Segments:
    """Variable-length segments of a flat sequence, grouped by length for batching:
    for each distinct length, the [count, length] indices of its segments' rows."""

    groups: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> Segments:
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths):
            if length:
                by_length.setdefault(length, []).append(start)
        groups = tuple(
            (torch.tensor(first, dtype=torch.int64)[:, None] + torch.arange(length)).to(device)
            for length, first in by_length.items()
        )
        return cls(groups)


def segment_attention(q, k, v, segments: Segments, scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v: [rows, heads, head_dim]."""
    out = torch.empty_like(q)
    for rows in segments.groups:  # [count, length]
        # -> [count, heads, length, head_dim]
        q_rows, k_rows, v_rows = (t[rows].transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q_rows, k_rows, v_rows, scale=scale)
        out[rows.reshape(-1)] = attended.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves, in fp32 as transformers rotates the tower's q and k."""
    values = x.float()
    half = values.shape[-1] // 2
    swapped = torch.cat((-values[..., half:], values[..., :half]), dim=-1)
    return (values * cos + swapped * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = segment_attention(q, k, v.contiguous(), segments, self.head_dim**-0.5)
        return self.proj(out.reshape(rows, -1))


class VisionMLP(nn.Module):
    # Named apart from the text model's gate_proj / up_proj, which the loader fuses
    # (`tower_name` maps transformers' names here).
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class QuickGeluMLP(nn.Module):
    """Qwen2-VL's MLP: fc1, x * sigmoid(1.702 x), fc2."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        return self.fc2(x * torch.sigmoid(1.702 * x))


def _norm(config: QwenVisionConfig, size: int) -> nn.Module:
    if config.layer_norm:
        return nn.LayerNorm(size, eps=config.rms_norm_eps)
    return RMSNorm(size, config.rms_norm_eps)


def tower_name(name: str) -> str:
    """A tensor name of transformers' tower (after its `visual.` prefix) -> ours."""
    for theirs, ours in ((".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up.")):
        name = name.replace(theirs, ours)
    return name.replace(".mlp.down_proj.", ".mlp.down.")


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.hidden_size)
        self.norm2 = _norm(config, config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config) if config.gated_mlp else QuickGeluMLP(config)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.group_size = config.hidden_size * config.merge_unit
        self.ln_q = _norm(config, config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.group_size, self.group_size),
            nn.GELU(),
            nn.Linear(self.group_size, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_size))


@dataclass(frozen=True)
class TowerLayout:
    """Where a call's patches go: the window order (whole merge groups), the 2D rotary
    position of each patch in that order, and the segments of full and window attention."""

    window_order: torch.Tensor  # [num_tokens] merged-token indices, in window order
    rows: torch.Tensor  # [num_patches] patch row within its image, in window order
    columns: torch.Tensor  # [num_patches]
    images: Segments
    windows: Segments


def tower_layout(
    config: QwenVisionConfig, grids: Sequence[tuple[int, int, int]], device: torch.device
) -> TowerLayout:
    """The layout of images of these grids (frames, rows, columns of patches)."""
    m, side = config.spatial_merge_size, config.window_tokens
    order, window_lengths, image_lengths, rows, columns = [], [], [], [], []
    first_token = 0
    for frames, height, width in grids:
        if frames != 1:
            raise ValueError(f"a grid of {frames} frames is a video; only images are supported")
        if height % m or width % m:
            raise ValueError(f"grid {height}x{width} is not a multiple of merge size {m}")
        token_rows, token_columns = height // m, width // m
        tokens = torch.arange(token_rows * token_columns).view(token_rows, token_columns)
        # Windows tile the merged tokens row-major; the last row and column of windows
        # may be partial. Without windows the image is one.
        rows_a_side, columns_a_side = (side, side) if side else (token_rows, token_columns)
        for top in range(0, token_rows, rows_a_side):
            for left in range(0, token_columns, columns_a_side):
                window = tokens[top : top + rows_a_side, left : left + columns_a_side]
                window = window.reshape(-1)
                order.append(window + first_token)
                window_lengths.append(len(window) * config.merge_unit)
                # Each merged token's patches, in the processor's order within a group.
                token_row, token_column = window // token_columns, window % token_columns
                in_group = torch.arange(config.merge_unit)
                rows.append((token_row[:, None] * m + in_group // m).reshape(-1))
                columns.append((token_column[:, None] * m + in_group % m).reshape(-1))
        image_lengths.append(height * width)
        first_token += token_rows * token_columns
    return TowerLayout(
        window_order=torch.cat(order).to(device),
        rows=torch.cat(rows).to(device),
        columns=torch.cat(columns).to(device),
        images=Segments.of(image_lengths, device),
        windows=Segments.of(window_lengths, device),
    )


class QwenVisionTower(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        if config.window_tokens is not None and config.window_tokens < 1:
            raise ValueError(
                f"vision window_size {config.window_size} is under one merged token "
                f"(spatial_merge_size * patch_size = "
                f"{config.spatial_merge_size * config.patch_size} px)"
            )
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.full_attention = frozenset(config.fullatt_block_indexes)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """patches [num_patches, C * T * P * P] of images of these grids, one after
        another -> their tokens [num_patches / merge_unit, out_hidden_size], in the
        same image order."""
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids holding {expected}")
        layout = tower_layout(self.config, grids, patches.device)
        unit = self.config.merge_unit
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[layout.window_order].view(-1, x.shape[-1])
        # Made here, not kept as a buffer: the loader skips initialising what it fills.
        rotary_dim = self.config.head_dim // 2  # each of the two axes rotates half a head
        exponents = torch.arange(0, rotary_dim, 2, device=patches.device).float() / rotary_dim
        inv_freq = 1.0 / self.config.rope_theta**exponents
        freqs = torch.cat(
            (layout.rows[:, None].float() * inv_freq, layout.columns[:, None].float() * inv_freq),
            dim=-1,
        )
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # broadcast over heads
        cos, sin = emb.cos(), emb.sin()
        for index, block in enumerate(self.blocks):
            segments = layout.images if index in self.full_attention else layout.windows
            x = block(x, cos, sin, segments)
        merged = self.merger(x)
        return merged[torch.argsort(layout.window_order)]


def num_image_tokens(config: QwenVisionConfig, grid: tuple[int, int, int]) -> int:
    """The tokens the tower makes of an image of this grid."""
    frames, height, width = grid
    return frames * height * width // config.merge_unit
