"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (on
unless config.json says otherwise, as transformers defaults them)."""

from __future__ import annotations

from tokenmill.engine.models.config import ModelConfig, common_fields
from tokenmill.engine.models.llama import LlamaForCausalLM
from tokenmill.engine.models.registry import Architecture, GGUFLayout, register


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


def parse_config(raw: dict) -> ModelConfig:
    return ModelConfig(**common_fields(raw, attention_bias=bool(raw.get("attention_bias", True))))


register(
    Architecture(
        names=("Qwen2ForCausalLM",),
        model_class=Qwen2ForCausalLM,
        parse_config=parse_config,
        model_types=("qwen2",),
        gguf=GGUFLayout("qwen2", "Qwen2ForCausalLM", "qwen2"),
    )
)
