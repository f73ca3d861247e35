"""Qwen3: the Llama decoder with q and k RMS-normalised per head before rotary; windows
as Qwen2's (only the layers from `max_window_layers` on slide)."""

from __future__ import annotations

from tokenmill.engine.models.config import ModelConfig, sliding_layers
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.llama import LlamaForCausalLM, decoder_config
from tokenmill.engine.models.qwen2 import SLIDING_FIELDS
from tokenmill.engine.models.registry import Architecture, GGUFLayout, register


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


def parse_config(raw: dict) -> ModelConfig:
    window, layer_types = sliding_layers(raw, raw["num_hidden_layers"])
    return decoder_config(
        raw,
        max_position_embeddings=32768,
        head_dim=128,  # transformers' default, not hidden_size / heads
        qk_norm=True,
        mlp_bias=False,
        sliding_window=window,
        layer_types=layer_types,
    )


# transformers' Qwen3Config, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED | SLIDING_FIELDS | {"attention_bias"},
    harmless=DECODER_HARMLESS,
)

register(
    Architecture(
        names=("Qwen3ForCausalLM",),
        model_class=Qwen3ForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("qwen3",),
        gguf=GGUFLayout("qwen3", "Qwen3ForCausalLM", "qwen3"),
    )
)
