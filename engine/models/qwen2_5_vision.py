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

Attention runs over variable-length segments (an image, or a window) without padding,
one batched scaled-dot-product call per distinct length. Which order the windows take
is ours to choose (attention within a window or an image does not depend on it, each
patch carries its own rotary position, and the merged tokens are put back in image order
at the end), so the windows of a call are ordered by length: every window block then
reads its segments in place, and only the few full-attention blocks gather an image's
patches from the windows they are spread over.

On CPU the linear layers are oneDNN-packed as the engine loads them, and each residual
add, the MLP's activation and its gate-times-up run inside the matmul that produces them
(fused_linear.py); the norms and the rotary run as fused native kernels where built
(layers.RMSNorm, rope.rotary_qkv). The rotary is computed in fp32 whatever the tower's
dtype, as transformers computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.models import layers
from tokenmill.engine.models.fused_linear import fused_linear
from tokenmill.engine.models.rope import rotary_qkv
from tokenmill.engine.models.vision_segments import (
    Segments,
    TowerLayout,
    segment_attention,
    tower_layout,
)


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


def _rotate_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated in fp32 (as transformers rotates the tower's q and k), back in
    qkv's dtype, and v. qkv: [rows, 3, heads, head_dim]; cos, sin: fp32 [rows, 1, head_dim],
    the sine signed for the swapped halves."""
    q, k, v = rotary_qkv(*qkv.float().unbind(1), cos, sin)
    if qkv.dtype == torch.float32:
        return q, k, v
    return q.to(qkv.dtype), k.to(qkv.dtype), qkv[:, 2]


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        """The attended values, before `proj` (which the block runs with its residual add)."""
        rows = x.shape[0]
        qkv = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim)
        q, k, v = _rotate_qkv(qkv, cos, sin)
        return segment_attention(q, k, v, segments, self.head_dim**-0.5).reshape(rows, -1)


class VisionMLP(nn.Module):
    # Named apart from the text model's gate_proj / up_proj, which the loader fuses
    # (`tower_name` maps transformers' names here).
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(silu(gate(x)) * up(x))."""
        gate = fused_linear(self.gate, x, activation="silu")
        return fused_linear(self.down, fused_linear(self.up, x, times=gate), residual=residual)


class QuickGeluMLP(nn.Module):
    """Qwen2-VL's MLP: fc1, x * sigmoid(1.702 x), fc2."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # oneDNN's swish post-op has no slope here (it ignores one), so the activation
        # is PyTorch's.
        x = self.fc1(x)
        return fused_linear(self.fc2, x * torch.sigmoid(1.702 * x), residual=residual)


def _norm(config: QwenVisionConfig, size: int) -> nn.Module:
    if config.layer_norm:
        return nn.LayerNorm(size, eps=config.rms_norm_eps)
    # transformers' Qwen2 RMSNorm: normalised in fp32, scaled by `weight` after the cast back.
    return layers.RMSNorm(size, config.rms_norm_eps)


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
        attended = self.attn(self.norm1(x), cos, sin, segments)
        x = fused_linear(self.attn.proj, attended, residual=x)
        return self.mlp(self.norm2(x), residual=x)


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
        first, _, second = self.mlp  # the GELU (exact, erf) runs inside the first
        grouped = self.ln_q(x).view(-1, self.group_size)
        return second(fused_linear(first, grouped, activation="gelu"))


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

    def layout(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> TowerLayout:
        config = self.config
        return tower_layout(
            grids,
            merge_size=config.spatial_merge_size,
            window_tokens=config.window_tokens,
            device=device,
        )

    def rotary_tables(self, layout: TowerLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_patches, 1, head_dim] in fp32 (the sine signed for the swapped
        halves): a patch's row rotates the first half of each head's frequencies, its
        column the second. Made per call, not kept as a buffer: the loader skips
        initialising what it fills."""
        rotary_dim = self.config.head_dim // 2  # each of the two axes rotates half a head
        device = layout.rows.device
        exponents = torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim
        inv_freq = 1.0 / self.config.rope_theta**exponents
        freqs = torch.cat(
            (layout.rows[:, None].float() * inv_freq, layout.columns[:, None].float() * inv_freq),
            dim=-1,
        )
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """patches [num_patches, C * T * P * P] of images of these grids, one after
        another -> their tokens [num_patches / merge_unit, out_hidden_size], in the
        same image order."""
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids holding {expected}")
        layout = self.layout(grids, patches.device)
        unit = self.config.merge_unit
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[layout.window_order].view(-1, x.shape[-1])
        cos, sin = self.rotary_tables(layout)
        for index, block in enumerate(self.blocks):
            segments = layout.images if index in self.full_attention else layout.windows
            x = block(x, cos, sin, segments)
        merged = self.merger(x)
        return merged[torch.argsort(layout.window_order)]


def num_image_tokens(config: QwenVisionConfig, grid: tuple[int, int, int]) -> int:
    """The tokens the tower makes of an image of this grid."""
    frames, height, width = grid
    return frames * height * width // config.merge_unit
