"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a Llama-shaped decoder with

- attention sinks: a learned logit per query head that joins every softmax's
  denominator with no value (so a head may attend to nothing), computed by the attention
  backends that say so (`AttentionBackend.computes_sinks`);
- alternating sliding and full attention (`layer_types`, `sliding_window`), biases on q,
  k, v and the output projection (`attention_bias`), yarn rope as the config says;
- a mixture of experts in every layer: a router with a bias whose top k logits are
  softmaxed among themselves, and experts with biases whose gate_up columns interleave
  (even: gate, odd: up) into a clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g)
  with g = gate clamped from above at `swiglu_limit`.

The experts load in transformers' layout, [num_experts, in, out] (the checkpoint's as
stored). On the CPU with the native kernels they are packed after loading into the
grouped kernel's (kernels/moe.c: the gate's columns, then the up's, with their biases and
the clamped SwiGLU); elsewhere they run as one grouped matmul per projection over the
tokens sorted by expert (moe.grouped_experts). The quantizations do not take these
experts, and are refused for them (quant/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.models.config import common_fields
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.llama import LlamaDecoderLayer
from tokenmill.engine.models.moe import (
    KernelExperts,
    MoeConfig,
    MoeForCausalLM,
    MoeModel,
    Router,
    Routing,
    grouped_experts,
    release_to_meta,
)
from tokenmill.engine.models.registry import Architecture, register


@dataclass
class GptOssConfig(MoeConfig):
    """MoeConfig plus the experts' clamped SwiGLU."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation over interleaved gate_up products, in transformers'
    operations and order: [rows, 2 * inter] -> [rows, inter]."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExperts(KernelExperts):
    """num_experts gated MLPs with biases, in the checkpoint's layout: gate_up_proj
    [num_experts, hidden, 2 * inter] (columns interleaved), gate_up_proj_bias
    [num_experts, 2 * inter], down_proj [num_experts, inter, hidden], down_proj_bias
    [num_experts, hidden]."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        experts, hidden, inter = (
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.num_experts = experts
        self.intermediate_size = inter
        self.activation = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.packed: moe_kernel.PackedExperts | None = None  # the native kernel's copy

    def pack(self) -> bool:
        """Move the weights into the native grouped kernel's layout where it serves them
        (the parameters then hold no memory); returns whether they are packed."""
        gate_up = self.gate_up_proj
        hidden, inter = gate_up.shape[1], self.intermediate_size
        if self.packed is not None or not moe_kernel.available(
            gate_up.dtype, gate_up.device, hidden, inter, 1
        ):
            return self.packed is not None
        # The kernel takes each expert's gate columns, then its up columns; the checkpoint
        # interleaves them (even: gate, odd: up).
        w, bias = gate_up.data, self.gate_up_proj_bias.data
        self.packed = moe_kernel.PackedExperts(
            torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1).transpose(1, 2),
            self.down_proj.data.transpose(1, 2),
            "clamped_swiglu",
            gate_up_bias=torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=-1),
            down_bias=self.down_proj_bias.data,
            swiglu=(self.activation.alpha, self.activation.limit),
        )
        release_to_meta(self, ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
        return True

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [num_tokens, hidden]; weights, expert_ids: [num_tokens, top_k] -> [num_tokens, hidden]."""
        if self.packed is not None:
            return self.packed(x, expert_ids, weights)
        return grouped_experts(
            x,
            weights,
            expert_ids,
            self.gate_up_proj.transpose(1, 2),  # [E, out, in] views, as grouped_experts takes
            self.down_proj.transpose(1, 2),
            self.activation,
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
        )


class GptOssMoeBlock(nn.Module):
    """The router (`router`, transformers' name) and the experts."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.router = Router(config.hidden_size, config.num_experts, config.routing, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.router(x)
        return self.experts(x, weights, expert_ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: GptOssConfig, layer_idx: int) -> nn.Module:
        return GptOssMoeBlock(config)


class GptOssModel(MoeModel):
    decoder_layer = GptOssDecoderLayer


class GptOssForCausalLM(MoeForCausalLM):
    base_model_class = GptOssModel


def parse_config(raw: dict) -> GptOssConfig:
    num_layers = raw["num_hidden_layers"]
    top_k = raw.get("num_experts_per_tok", 4)
    # transformers' default: even layers slide, odd ones see everything.
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    fields = common_fields(raw, max_position_embeddings=131072, head_dim=64)
    return GptOssConfig(
        **{
            **fields,
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
            "attention_bias": bool(raw.get("attention_bias", True)),
            "attention_output_bias": bool(raw.get("attention_bias", True)),
        },
        attention_sinks=True,
        quantizable_experts=False,
        sliding_window=raw.get("sliding_window", 128),
        layer_types=list(layer_types),
        num_experts=raw.get("num_local_experts", raw.get("num_experts", 128)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"],
        routing=Routing(top_k, renormalize=False, softmax_of_top_k=True),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


# transformers' GptOssConfig, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED
    | {
        "attention_bias",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "swiglu_alpha",
        "swiglu_limit",
    },
    harmless={
        **DECODER_HARMLESS,
        "output_router_logits": "what transformers' forward returns, not what it computes",
        "router_aux_loss_coef": "the router's training loss",
    },
)

register(
    Architecture(
        names=("GptOssForCausalLM",),
        model_class=GptOssForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("gpt_oss",),
    )
)
