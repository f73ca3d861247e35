"""Mixtral: the Mistral decoder with a mixture of experts in place of every MLP - softmax
routing to the top `num_experts_per_tok` of `num_local_experts`, the k weights always
renormalised and kept in fp32 - and a window on every layer where `sliding_window` is set.
Its checkpoints name the block `block_sparse_moe` and the projections w1 (gate), w3 (up)
and w2 (down). llama.cpp writes it as a `llama` GGUF whose `llama.expert_count` is set:
q/k rows permuted as Llama's, the router `ffn_gate_inp` and each projection's experts
stacked (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`) - or, as its converter once
wrote them, one tensor per expert (`ffn_gate.E` ...: GGUFLayout.hf_tensor_name), which
the load stacks expert by expert."""

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

# Mixtral's checkpoint names -> the ones the Llama-family loader maps.
_RENAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


class MixtralForCausalLM(MoeForCausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str:
        for theirs, ours in _RENAMES.items():
            name = name.replace(theirs, ours)
        return name


def parse_config(raw: dict) -> MoeConfig:
    top_k = raw.get("num_experts_per_tok", 2)
    fields = common_fields(raw, max_position_embeddings=131072)
    return MoeConfig(
        **{**fields, "rms_norm_eps": raw.get("rms_norm_eps", 1e-5)},
        sliding_window=raw.get("sliding_window"),
        num_experts=raw.get("num_local_experts", raw.get("num_experts", 8)),
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"],
        routing=Routing(top_k, renormalize=True, round_to_model_dtype=False),
    )


# transformers' MixtralConfig, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED
    | {"sliding_window", "num_experts_per_tok", "num_local_experts", "num_experts"},
    harmless={
        **DECODER_HARMLESS,
        "output_router_logits": "what transformers' forward returns, not what it computes",
        "router_aux_loss_coef": "the router's training loss",
        "router_jitter_noise": "noise on the router's input in training only",
    },
)


def gguf_config(config: dict, get) -> dict:
    """llama.cpp's llama with experts: every layer sparse, the experts feed_forward_length
    wide, the top-k weights renormalised (parse_config's routing), no window."""
    return {
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
    }


register(
    Architecture(
        names=("MixtralForCausalLM",),
        model_class=MixtralForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("mixtral",),
        gguf=GGUFLayout(
            "llama",
            "MixtralForCausalLM",
            "mixtral",
            block_names=MOE_GGUF_BLOCK_NAMES,
            permuted_qk=True,
            extra_config=gguf_config,
            experts=True,
        ),
    )
)
