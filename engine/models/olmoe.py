"""OLMoE: a Llama-shaped decoder with a mixture of experts in every layer - softmax routing
to the top `num_experts_per_tok` of `num_experts`, the k weights not renormalised (unless
`norm_topk_prob`) - and q and k RMS-normalised over their whole projections (not per
head) before rotary; `clip_qkv` clamps q, k and v."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.config import common_fields
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.layers import RMSNorm
from tokenmill.engine.models.llama import LlamaAttention
from tokenmill.engine.models.moe import (
    MoeConfig,
    MoeDecoderLayer,
    MoeForCausalLM,
    MoeModel,
    Routing,
)
from tokenmill.engine.models.registry import (
    MOE_GGUF_BLOCK_NAMES,
    Architecture,
    GGUFLayout,
    register,
)
from tokenmill.engine.models.rope import rotary_qkv


@dataclass
class OlmoeConfig(MoeConfig):
    """MoeConfig plus OLMoE's clamp of q, k and v (None: none)."""

    clip_qkv: float | None = None


class OlmoeAttention(LlamaAttention):
    """Llama attention with q and k normalised across all their heads at once."""

    def __init__(self, config: OlmoeConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepAttention
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k, v = rotary_qkv(q, k, v, cos, sin)
        o = meta.attend(q, k, v, self.k_cache, self.v_cache, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeModel(MoeModel):
    decoder_layer = OlmoeDecoderLayer


class OlmoeForCausalLM(MoeForCausalLM):
    base_model_class = OlmoeModel


def parse_config(raw: dict) -> OlmoeConfig:
    top_k = raw.get("num_experts_per_tok", 8)
    fields = common_fields(raw, max_position_embeddings=4096)
    return OlmoeConfig(
        **{**fields, "rms_norm_eps": raw.get("rms_norm_eps", 1e-5)},
        num_experts=raw.get("num_experts", raw.get("num_local_experts", 64)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"],
        routing=Routing(top_k, renormalize=bool(raw.get("norm_topk_prob", False))),
        clip_qkv=raw.get("clip_qkv"),
    )


# transformers' OlmoeConfig, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED
    | {
        "attention_bias",
        "clip_qkv",
        "num_experts_per_tok",
        "num_experts",
        "num_local_experts",
        "norm_topk_prob",
    },
    harmless={
        **DECODER_HARMLESS,
        "output_router_logits": "what transformers' forward returns, not what it computes",
        "router_aux_loss_coef": "the router's training loss",
    },
)


def gguf_config(config: dict, get) -> dict:
    """llama.cpp's olmoe: the experts feed_forward_length wide, the top-k weights as
    softmaxed (never renormalised), no clamp."""
    return {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "norm_topk_prob": False,
    }


register(
    Architecture(
        names=("OlmoeForCausalLM",),
        model_class=OlmoeForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("olmoe",),
        gguf=GGUFLayout(
            "olmoe",
            "OlmoeForCausalLM",
            "olmoe",
            block_names=MOE_GGUF_BLOCK_NAMES,
            extra_config=gguf_config,
        ),
    )
)
