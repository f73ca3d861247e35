"""LoRA on the decoder's fused projections: which layer a PEFT target is, and the wrapper
that adds each adapter's low-rank term to the rows that use it.

PEFT names a Llama-family decoder's projections as transformers does (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj); the engine fuses q/k/v into `qkv_proj`
and gate/up into `gate_up_proj` (the model's `packed_modules`). A target is therefore a
slice of a fused layer's output: its rows `[offset, offset + out)`.

`LoRALinear` wraps one such layer. Its base (float, oneDNN-packed or quantized) runs once
on the whole step; then, for each run of rows that share an adapter (the step's
`LoRAStep.segments`, set by the runner), it adds `(x @ A^T) @ B^T` for that adapter:
A stacks the adapter's lora_A of every target in the layer ([r_total, in]), B places
each target's lora_B, pre-multiplied by its scaling, in that target's output rows and
rank columns ([out, r_total], zero elsewhere). One shrink and one expand per adapter per
layer, whatever subset of the layer's targets the adapter has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.engine.models.config import ModelConfig

# PEFT target name -> (the decoder block's submodule, the engine's layer there).
LORA_TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


@dataclass(frozen=True)
class TargetShape:
    """Where a PEFT target sits in the engine's layer, and its shape."""

    parent: str  # "self_attn" | "mlp"
    layer: str  # the engine's (possibly fused) linear layer
    in_features: int
    out_features: int
    offset: int  # its first output row in the fused layer's output


def target_shapes(config: ModelConfig) -> dict[str, TargetShape]:
    """Every PEFT target of a decoder layer with this config, by its PEFT name."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": TargetShape("self_attn", "qkv_proj", hidden, q_size, 0),
        "k_proj": TargetShape("self_attn", "qkv_proj", hidden, kv_size, q_size),
        "v_proj": TargetShape("self_attn", "qkv_proj", hidden, kv_size, q_size + kv_size),
        "o_proj": TargetShape("self_attn", "o_proj", q_size, hidden, 0),
        "gate_proj": TargetShape("mlp", "gate_up_proj", hidden, inter, 0),
        "up_proj": TargetShape("mlp", "gate_up_proj", hidden, inter, inter),
        "down_proj": TargetShape("mlp", "down_proj", inter, hidden, 0),
    }


@dataclass
class LoRAStep:
    """The step's rows by adapter, shared by every LoRALinear of a model; the runner sets
    `segments` before the forward pass and clears it after."""

    # (slot, first row, end row): rows [first, end) of the step's batch use the adapter in
    # `slot`. None: no row of this step uses an adapter - the wrappers only run their base.
    segments: list[tuple[int, int, int]] | None = None


@dataclass
class SlotWeights:
    """One adapter's term for one layer, ready to multiply: x @ a_t @ b_t."""

    a_t: torch.Tensor  # [in, r_total]: lora_A of each target, stacked and transposed
    b_t: torch.Tensor  # [r_total, out]: scaling * lora_B of each target, in its rows
    targets: tuple[str, ...] = field(default=())  # the PEFT targets it covers


class LoRALinear(nn.Module):
    """A linear layer (any of the engine's kinds) plus per-row LoRA terms.

    Args:
        base: the layer; it keeps computing the whole batch.
        step: the model's shared LoRAStep.
        num_slots: how many adapters can be loaded at once (max_loras).
    """

    def __init__(self, base: nn.Module, step: LoRAStep, num_slots: int) -> None:
        super().__init__()
        self.base_layer = base
        self.step = step
        self.slots: list[SlotWeights | None] = [None] * num_slots

    @property
    def fused_activation(self) -> str | None:
        """The base's fused activation (an int8 gate_up, quant/int8.py), on steps without
        adapters only: an adapter's term must be added before the activation."""
        if self.step.segments is not None:
            return None
        return getattr(self.base_layer, "fused_activation", None)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out] (or the base's fused activation's)."""
        y = self.base_layer(x, **kwargs)
        segments = self.step.segments
        if segments is None:
            return y
        for slot, start, end in segments:
            weights = self.slots[slot]
            if weights is not None:
                # y[start:end] is a view: the term is added in place, in y's dtype.
                y[start:end].addmm_(x[start:end] @ weights.a_t, weights.b_t)
        return y

    def extra_repr(self) -> str:
        loaded = sum(1 for s in self.slots if s is not None)
        return f"slots={len(self.slots)}, loaded={loaded}"
