"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (always:
transformers' Qwen2 has them whatever `attention_bias` says), and sliding-window
attention on the layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from tokenmill.engine.models.config import ModelConfig, sliding_layers
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.llama import LlamaForCausalLM, decoder_config
from tokenmill.engine.models.registry import Architecture, GGUFLayout, register

# The window fields transformers' Qwen2 and Qwen3 read (config.sliding_layers).
SLIDING_FIELDS = frozenset(
    {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
)


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


def parse_config(raw: dict) -> ModelConfig:
    window, layer_types = sliding_layers(raw, raw["num_hidden_layers"])
    return decoder_config(
        raw,
        max_position_embeddings=32768,
        attention_bias=True,
        attention_output_bias=False,
        mlp_bias=False,
        sliding_window=window,
        layer_types=layer_types,
    )


# transformers' Qwen2Config, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED | SLIDING_FIELDS,
    harmless={
        **DECODER_HARMLESS,
        "attention_bias": "transformers' Qwen2 has q/k/v biases and no other whatever it says",
    },
)

register(
    Architecture(
        names=("Qwen2ForCausalLM",),
        model_class=Qwen2ForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("qwen2",),
        gguf=GGUFLayout("qwen2", "Qwen2ForCausalLM", "qwen2"),
    )
)
