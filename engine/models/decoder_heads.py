"""Decoders that pool instead of generating: the bare model (`Qwen3Model`, `Qwen2Model`,
`LlamaModel` - Qwen3-Embedding's layout) and the sequence-classification head
(`*ForSequenceClassification`: a linear `score` over the last token's hidden state).

They run in the decode loop like any decoder (paged KV cache, prefix cache, chunked
prefill) as prompt-only requests; `pooling/pooler.py` reads their final hidden states.
There is no lm_head, so they cannot generate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from tokenmill.engine.models import llama, qwen2, qwen3
from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.layers import Linear
from tokenmill.engine.models.llama import LlamaForCausalLM, LlamaModel
from tokenmill.engine.models.registry import Architecture, register
from tokenmill.engine.models.rope import RotaryEmbedding


@dataclass
class DecoderHeadConfig(ModelConfig):
    """ModelConfig plus the classification head's size."""

    num_labels: int = 0


class DecoderForEmbedding(nn.Module):
    """A decoder's layers and final norm, no lm_head: hidden states to pool."""

    packed_modules = LlamaForCausalLM.packed_modules
    head_pooling: str | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary: RotaryEmbedding | None = None

    attach_rotary = LlamaForCausalLM.attach_rotary

    forward = LlamaForCausalLM.forward

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A bare model's checkpoint names its tensors without "model." (as
        `Qwen3Model.save_pretrained` does); a task checkpoint with it."""
        if name.startswith(("model.", "score.")):
            return name
        return None if name.startswith("lm_head.") else f"model.{name}"


class DecoderForSequenceClassification(DecoderForEmbedding):
    """A decoder with a linear head over its last token (transformers'
    `*ForSequenceClassification`, no bias)."""

    head_pooling = "lasttoken"

    def __init__(self, config: DecoderHeadConfig) -> None:
        super().__init__(config)
        if config.num_labels < 1:
            raise ValueError("a sequence-classification model needs id2label or num_labels")
        self.score = Linear(config.hidden_size, config.num_labels, bias=False)

    def classify(self, last: torch.Tensor) -> torch.Tensor:
        """The last tokens' hidden states [num_seqs, hidden] -> fp32 logits."""
        return self.score(last).float()


def _with_head(parse):
    """A family's config parser, for a model with no lm_head (nothing to tie) and with
    the classification head's size."""

    def parse_config(raw: dict) -> DecoderHeadConfig:
        base = parse(raw)
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        values["tie_word_embeddings"] = False
        num_labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 0) or 0)
        return DecoderHeadConfig(**values, num_labels=num_labels)

    return parse_config


for _name, _family in (("Llama", llama), ("Qwen2", qwen2), ("Qwen3", qwen3)):
    register(
        Architecture(
            names=(f"{_name}Model",),
            model_class=DecoderForEmbedding,
            parse_config=_with_head(_family.parse_config),
            config_fields=_family.CONFIG_FIELDS,  # transformers' config class is the family's
            tasks=("embed",),
        )
    )
    register(
        Architecture(
            names=(f"{_name}ForSequenceClassification",),
            model_class=DecoderForSequenceClassification,
            parse_config=_with_head(_family.parse_config),
            config_fields=_family.CONFIG_FIELDS,
            tasks=("classify", "rerank"),
        )
    )
