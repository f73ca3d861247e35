"""Model classes by the architecture name in config.json."""

from __future__ import annotations

from torch import nn

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.models.gemma3 import Gemma3ForCausalLM
from tokenmill.engine.models.llama import LlamaForCausalLM
from tokenmill.engine.models.qwen2 import Qwen2ForCausalLM
from tokenmill.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES[config.architecture]
