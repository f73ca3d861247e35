"""Mistral: the Llama decoder with every layer attending to a sliding window of the last
`sliding_window` positions, and no biases (transformers' Mistral has none to switch on)."""

from __future__ import annotations

from tokenmill.engine.models.config import SLIDING_ATTENTION, ModelConfig
from tokenmill.engine.models.config_fields import (
    DECODER_HARMLESS,
    LLAMA_FAMILY_HANDLED,
    Refused,
    declare,
)
from tokenmill.engine.models.llama import LlamaForCausalLM, decoder_config
from tokenmill.engine.models.registry import Architecture, register


class MistralForCausalLM(LlamaForCausalLM):
    pass


def parse_config(raw: dict) -> ModelConfig:
    return decoder_config(
        raw,
        max_position_embeddings=4096 * 32,
        sliding_window=raw.get("sliding_window", 4096),
    )


def _layer_types_as_transformers_runs(value, raw: dict) -> bool:
    """transformers' Mistral ignores layer_types (a Ministral checkpoint has them): they
    change nothing only where they say what it runs - every layer alike."""
    kind = "full_attention" if raw.get("sliding_window", 4096) is None else SLIDING_ATTENTION
    return value is None or all(entry == kind for entry in value)


# transformers' MistralConfig, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED | {"sliding_window"},
    harmless=DECODER_HARMLESS,
    refused={
        "layer_types": Refused(
            "per-layer attention kinds, which transformers' Mistral ignores",
            _layer_types_as_transformers_runs,
        ),
    },
)

register(
    Architecture(
        names=("MistralForCausalLM",),
        model_class=MistralForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("mistral",),
    )
)
