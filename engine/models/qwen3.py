"""Qwen3: the Llama decoder with q and k RMS-normalised per head before rotary."""

from __future__ import annotations

from tokenmill.engine.models.config import ModelConfig, common_fields
from tokenmill.engine.models.llama import LlamaForCausalLM
from tokenmill.engine.models.registry import Architecture, GGUFLayout, register


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


def parse_config(raw: dict) -> ModelConfig:
    return ModelConfig(**common_fields(raw, qk_norm=True))


register(
    Architecture(
        names=("Qwen3ForCausalLM",),
        model_class=Qwen3ForCausalLM,
        parse_config=parse_config,
        model_types=("qwen3",),
        gguf=GGUFLayout("qwen3", "Qwen3ForCausalLM", "qwen3"),
    )
)
