"""The SigLIP vision tower (as Gemma 3 uses it: no pooling head) and Gemma 3's
multi-modal projector, batched over many images per call.

The tower is a ViT: non-overlapping patches embedded by a strided convolution, learned
position embeddings, pre-LayerNorm encoder layers with full bidirectional attention over
an image's patches and a tanh-GELU MLP, then a final LayerNorm. The projector averages
the patch grid down to the model's soft tokens per image, RMS-normalises them with
Gemma's (1 + weight) scale and maps them into the text model's embedding space.

Its layers are plain torch modules (nn.Linear, nn.LayerNorm): the text model's fused
projections, LoRA slots and KV cache never see them. On CPU the linear layers are
oneDNN-packed as the engine loads them, and each residual add and the MLP's GELU run
inside the matmul that produces them (fused_linear.py). In bf16 the GELU is a native pass
over fc1's product instead, and each residual add runs with the LayerNorm after it (the
layer's own second, the next layer's first, the tower's last) as one native pass
(residual_then_norm). In bf16 on CPUs with AMX tiles the attention runs
in the native kernel vision_attention.c (both products on tiles, a flash-style softmax);
elsewhere in PyTorch's scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import elementwise, vision_attention
from tokenmill.engine.models.fused_linear import fused_linear


@dataclass(frozen=True)
class VisionConfig:
    """transformers' SiglipVisionConfig, the fields the tower reads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        # Three linears, not one fused qkv: fused measured no faster on the 896 px tower
        # (slower with the AMX attention, which then reads each row of k and v among
        # rows three times as wide).
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """attention(x) before out_proj. x: [num_images, num_patches, hidden]; every patch
        sees every patch of its image."""
        n, length, hidden = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        scale = self.head_dim**-0.5
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and vision_attention.available():
            return vision_attention.vision_attention(q, k, v, self.num_heads, scale)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale)
        return out.transpose(1, 2).reshape(n, length, hidden)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x), out_proj included (the encoder layer calls `attend` and
        adds the residual with its next LayerNorm, residual_then_norm)."""
        return fused_linear(self.out_proj, self.attend(x), residual=residual)


def residual_then_norm(
    linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + linear(x), norm of that sum; None without a norm).

    In bf16 on CPU the add and the norm are one native pass over the plain matmul's output
    (elementwise.add_layer_norm), which measured faster than the add as the matmul's
    oneDNN post-op followed by PyTorch's LayerNorm; elsewhere those two.
    """
    native = (
        norm is not None
        and x.dtype == torch.bfloat16
        and elementwise.supports(x)
        and norm.weight.dtype == residual.dtype == x.dtype
    )
    if native:
        return elementwise.add_layer_norm(
            linear(x).contiguous(), residual.contiguous(), norm.weight, norm.bias, norm.eps
        )
    out = fused_linear(linear, x, residual=residual)
    return out, None if norm is None else norm(out)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, hidden)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor | None = None,
        next_norm: nn.LayerNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output, and `next_norm` of it (the next layer's first LayerNorm or
        the tower's last), computed with its last residual add. normed: layer_norm1(x),
        where the previous layer computed it."""
        if normed is None:
            normed = self.layer_norm1(x)
        attended = self.self_attn.attend(normed)
        x, normed = residual_then_norm(self.self_attn.out_proj, attended, x, self.layer_norm2)
        inner = fused_linear(self.fc1, normed, activation="gelu_pytorch_tanh")
        return residual_then_norm(self.fc2, inner, x, next_norm)


class SiglipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, hidden)
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [num_images, 3, image_size, image_size] ->
        [num_images, num_patches, hidden] (patches in row-major order)."""
        size = self.config.image_size
        if tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(
                f"pixel values of shape {tuple(pixel_values.shape)}; the tower takes "
                f"[n, {self.config.num_channels}, {size}, {size}]"
            )
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.position_embedding.weight
        normed = None
        # each layer's last add runs with the LayerNorm after it (none for a tower of none)
        norms_after = [layer.layer_norm1 for layer in self.layers[1:]] + [self.post_layernorm]
        for layer, next_norm in zip(self.layers, norms_after, strict=False):
            x, normed = layer(x, normed, next_norm)
        return self.post_layernorm(x) if normed is None else normed


class Gemma3Projector(nn.Module):
    """The tower's patch grid -> `tokens_per_image` soft tokens in the text model's space."""

    def __init__(self, config: VisionConfig, text_hidden_size: int, tokens_per_image: int):
        super().__init__()
        side = int(round(tokens_per_image**0.5))
        if side * side != tokens_per_image or config.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} does not pool a "
                f"{config.patches_per_side}x{config.patches_per_side} patch grid evenly"
            )
        self.kernel = config.patches_per_side // side
        self.eps = config.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(config.hidden_size, text_hidden_size)
        )
        self.mm_soft_emb_norm_weight = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[num_images, num_patches, vision_hidden] -> [num_images, tokens, text_hidden]."""
        n, num_patches, hidden = patches.shape
        side = int(round(num_patches**0.5))
        grid = patches.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        # Gemma's RMSNorm: in fp32, scaled by (1 + weight), rounded back once.
        scale = self.mm_soft_emb_norm_weight.float() + 1.0
        normed = F.rms_norm(pooled.float(), (hidden,), scale, self.eps).to(pooled.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(patches.dtype)
