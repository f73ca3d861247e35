"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q and k RMS-normalised per
head) and a mixture of experts in place of the MLP - softmax routing to the top
`num_experts_per_tok` of `num_experts`, renormalised with `norm_topk_prob` - except on the
layers `mlp_only_layers` names and those `decoder_sparse_step` skips, which keep a dense
gated MLP of `intermediate_size`. `use_sliding_window` slides every layer."""

from __future__ import annotations

from tokenmill.engine.models.config import common_fields
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.moe import MoeConfig, MoeForCausalLM, Routing
from tokenmill.engine.models.registry import (
    MOE_GGUF_BLOCK_NAMES,
    Architecture,
    GGUFLayout,
    register,
)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


def parse_config(raw: dict) -> MoeConfig:
    num_layers = raw["num_hidden_layers"]
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    step = raw.get("decoder_sparse_step", 1)
    mlp_only = set(raw.get("mlp_only_layers") or ())
    # transformers' rule: a layer has experts unless it is named, or there are none, or
    # the step skips it.
    dense = [i for i in range(num_layers) if i in mlp_only or num_experts <= 0 or (i + 1) % step]
    top_k = raw.get("num_experts_per_tok", 8)
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    fields = common_fields(raw, max_position_embeddings=32768, head_dim=128)
    return MoeConfig(
        **{**fields, "mlp_bias": False, "attention_output_bias": fields["attention_bias"]},
        qk_norm=True,
        sliding_window=window,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=raw.get("moe_intermediate_size", 768),
        routing=Routing(top_k, renormalize=bool(raw.get("norm_topk_prob", False))),
        dense_layers=tuple(dense),
    )


# transformers' Qwen3MoeConfig, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED
    | {
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "decoder_sparse_step",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
        "num_local_experts",
        "norm_topk_prob",
        "mlp_only_layers",
    },
    harmless={
        **DECODER_HARMLESS,
        "output_router_logits": "what transformers' forward returns, not what it computes",
        "router_aux_loss_coef": "the router's training loss",
    },
)


def gguf_config(config: dict, get) -> dict:
    """llama.cpp's qwen3moe: every layer sparse, the top-k weights always renormalised."""
    return {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "intermediate_size": config["intermediate_size"] or get("expert_feed_forward_length"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


register(
    Architecture(
        names=("Qwen3MoeForCausalLM",),
        model_class=Qwen3MoeForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("qwen3_moe",),
        gguf=GGUFLayout(
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            block_names=MOE_GGUF_BLOCK_NAMES,
            extra_config=gguf_config,
        ),
    )
)
