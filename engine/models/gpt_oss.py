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
stored) - or, from a checkpoint whose quantization_config says `mxfp4` (gpt-oss as
released), as its MXFP4 `*_blocks` and `*_scales` uint8 tensors, never widened: they run
only on the native kernel, which reads MXFP4 (quant/mxfp4.py). On the CPU with the native kernels they are packed after loading into the
grouped kernel's (kernels/moe.c: the gate's columns, then the up's, with their biases and
the clamped SwiGLU); elsewhere they run as one grouped matmul per projection over the
tokens sorted by expert (moe.grouped_experts). Float experts pack as int8 or int4 under
those quantizations (the kernel adds the biases and computes the activation whatever the
weights' format); MXFP4 ones are 4-bit as stored, and those modes are refused for them
(quant/__init__.py).
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
    mxfp4_experts: bool = False  # the checkpoint stores the experts in MXFP4


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
        self.mxfp4 = config.mxfp4_experts
        if self.mxfp4:  # as stored: [experts, out, in / 32, 16] codes, [..., in / 32] scales
            for name, (n, k) in {
                "gate_up_proj": (2 * inter, hidden),
                "down_proj": (hidden, inter),
            }.items():
                if k % moe_kernel.MXFP4_BLOCK:
                    raise ValueError(f"MXFP4 {name} needs inputs in blocks of 32, not {k}")
                blocks = torch.empty(
                    experts,
                    n,
                    k // moe_kernel.MXFP4_BLOCK,
                    moe_kernel.MXFP4_BLOCK // 2,
                    dtype=torch.uint8,
                )
                scales = torch.empty(experts, n, k // moe_kernel.MXFP4_BLOCK, dtype=torch.uint8)
                setattr(self, f"{name}_blocks", nn.Parameter(blocks, requires_grad=False))
                setattr(self, f"{name}_scales", nn.Parameter(scales, requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
            self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.packed: moe_kernel.PackedExperts | None = None  # the native kernel's copy

    def pack(self, weight_format: str = "float") -> bool:
        """Move the weights into the native grouped kernel's layout where it serves them
        (the parameters then hold no memory); returns whether they are packed.
        weight_format: "float" (the parameters' dtype), "int8" or "int4" (float experts
        only: moe_kernel.PackedExperts); MXFP4 experts pack as stored.

        Raises:
            ValueError: MXFP4 experts where the native kernel does not run, or asked to
                pack in another format.
        """
        bias = self.gate_up_proj_bias
        dtype, hidden, inter = bias.dtype, self.down_proj_bias.shape[1], self.intermediate_size
        if self.packed is not None:
            return True
        if self.mxfp4 and weight_format != "float":
            raise ValueError(f"MXFP4 experts are packed as stored, not as {weight_format}")
        if not moe_kernel.available(dtype, bias.device, hidden, inter, 1):
            if self.mxfp4:
                raise ValueError(
                    "MXFP4 experts run on the native CPU kernels only, in fp32 or bf16 "
                    f"(here: {bias.device.type}, {dtype})"
                )
            return False
        kernel_args = dict(
            # The kernel takes each expert's gate columns, then its up columns; the
            # checkpoint interleaves them (even: gate, odd: up).
            gate_up_bias=_gate_then_up(bias.data, dim=1),
            down_bias=self.down_proj_bias.data,
            swiglu=(self.activation.alpha, self.activation.limit),
        )
        if self.mxfp4:
            self.packed = moe_kernel.PackedExperts.from_mxfp4(
                (
                    _gate_then_up(self.gate_up_proj_blocks.data, dim=1),
                    _gate_then_up(self.gate_up_proj_scales.data, dim=1),
                ),
                (self.down_proj_blocks.data, self.down_proj_scales.data),
                dtype,
                "clamped_swiglu",
                **kernel_args,
            )
            weights = ("gate_up_proj_blocks", "gate_up_proj_scales")
            weights += ("down_proj_blocks", "down_proj_scales")
        else:
            self.packed = moe_kernel.PackedExperts(
                _gate_then_up(self.gate_up_proj.data, dim=2).transpose(1, 2),
                self.down_proj.data.transpose(1, 2),
                "clamped_swiglu",
                weight_format,
                **kernel_args,
            )
            weights = ("gate_up_proj", "down_proj")
        release_to_meta(self, (*weights, "gate_up_proj_bias", "down_proj_bias"))
        return True

    def planned_bytes(self, device: torch.device, weight_format: str) -> int | None:
        dtype, hidden = self.gate_up_proj_bias.dtype, self.down_proj_bias.shape[1]
        if not moe_kernel.available(dtype, device, hidden, self.intermediate_size, 1):
            return None  # float experts stay float (MXFP4 ones are refused by pack)
        if self.mxfp4:
            if weight_format != "float":
                raise ValueError(f"MXFP4 experts are packed as stored, not as {weight_format}")
            weight_format = "mxfp4"
        return moe_kernel.packed_bytes(
            self.num_experts, hidden, self.intermediate_size, dtype, weight_format, biases=True
        )

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [num_tokens, hidden]; weights, expert_ids: [num_tokens, top_k] -> [num_tokens, hidden]."""
        if self.packed is not None:
            return self.packed(x, expert_ids, weights)
        if self.mxfp4:
            raise RuntimeError("MXFP4 experts were used before they were packed")
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


def _gate_then_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along `dim` (even: gate, odd: up) -> the gate's, then
    the up's."""
    index = torch.arange(t.shape[dim])
    return t.index_select(dim, torch.cat((index[0::2], index[1::2])))


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
    mxfp4 = mxfp4_experts(raw)
    return GptOssConfig(
        **{
            **fields,
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
            "attention_bias": bool(raw.get("attention_bias", True)),
            "attention_output_bias": bool(raw.get("attention_bias", True)),
        },
        attention_sinks=True,
        quantizable_experts=not mxfp4,
        sliding_window=raw.get("sliding_window", 128),
        layer_types=list(layer_types),
        num_experts=raw.get("num_local_experts", raw.get("num_experts", 128)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"],
        routing=Routing(top_k, renormalize=False, softmax_of_top_k=True),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        mxfp4_experts=mxfp4,
    )


def mxfp4_experts(raw: dict) -> bool:
    """Whether config.json's quantization_config stores the experts in MXFP4 (gpt-oss as
    released: every expert, nothing else).

    Raises:
        ValueError: MXFP4 that leaves experts in float (`modules_to_not_convert`).
    """
    settings = raw.get("quantization_config") or {}
    if settings.get("quant_method") != "mxfp4":
        return False
    kept = [m for m in settings.get("modules_to_not_convert") or () if "experts" in m]
    if kept:
        raise ValueError(
            f"MXFP4 checkpoint keeps experts in float (modules_to_not_convert: {kept}); "
            "only checkpoints with every expert in MXFP4 are read"
        )
    return True


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
