"""Gemma 3 with images (Gemma3ForConditionalGeneration): the Gemma 3 text model, plus a
SigLIP tower and projector (siglip.py) whose soft tokens replace the embeddings of the
prompt's image tokens.

As transformers computes it:
- each image becomes `mm_tokens_per_image` soft tokens placed at the prompt's image-token
  ids; they enter the decoder as they come out of the projector (the text embeddings'
  sqrt(hidden) scale is not applied to them);
- an image's tokens attend to each other bidirectionally (and causally to everything
  before the image), in local layers within the window: the worker attends so
  (`worker/attention/image_spans.py`), and the scheduler never splits an image across
  prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.config_fields import declare
from tokenmill.engine.models.gemma3 import CONFIG_FIELDS as TEXT_CONFIG_FIELDS
from tokenmill.engine.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from tokenmill.engine.models.gemma3 import parse_config as parse_text_config
from tokenmill.engine.models.registry import Architecture, register
from tokenmill.engine.models.siglip import Gemma3Projector, SiglipVisionTower, VisionConfig

ARCHITECTURE = "Gemma3ForConditionalGeneration"


@dataclass
class Gemma3VisionConfig(Gemma3Config):
    """Gemma3Config plus the vision tower and how images appear in a prompt."""

    vision: VisionConfig | None = None
    tokens_per_image: int = 256
    boi_token_id: int = 255_999  # <start_of_image>, where a prompt places an image
    eoi_token_id: int = 256_000  # <end_of_image>
    image_token_id: int = 262_144  # <image_soft_token>, one per soft token


# transformers' SiglipVisionConfig, field by field.
VISION_CONFIG_FIELDS = declare(
    handled={
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_channels",
        "image_size",
        "patch_size",
        "hidden_act",
        "layer_norm_eps",
    },
    harmless={
        "vision_use_head": "the tower's pooling head, whose output Gemma 3 never reads "
        "(its tensors are left unread)",
        "attention_dropout": "dropout is off at inference",
        "initializer_range": "initialises weights for training; the checkpoint replaces them",
    },
)


def parse_vision_config(raw: dict) -> VisionConfig:
    VISION_CONFIG_FIELDS.check(raw, f"{ARCHITECTURE} vision_config")
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{ARCHITECTURE}: vision_config.hidden_act {act!r} is not supported")
    return VisionConfig(
        hidden_size=raw.get("hidden_size", 768),
        intermediate_size=raw.get("intermediate_size", 3072),
        num_hidden_layers=raw.get("num_hidden_layers", 12),
        num_attention_heads=raw.get("num_attention_heads", 12),
        image_size=raw.get("image_size", 224),
        patch_size=raw.get("patch_size", 16),
        num_channels=raw.get("num_channels", 3),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-6),
    )


def parse_config(raw: dict) -> Gemma3VisionConfig:
    """The nested config.json of Gemma3ForConditionalGeneration (text_config and
    vision_config, each checked against its own field table)."""
    text_raw = dict(raw.get("text_config") or {})
    text_raw.setdefault("architectures", ["Gemma3ForCausalLM"])
    TEXT_CONFIG_FIELDS.check(text_raw, f"{ARCHITECTURE} text_config")
    text = parse_text_config(text_raw)
    base = {f: getattr(text, f) for f in text.__dataclass_fields__}
    return Gemma3VisionConfig(
        **{**base, "architecture": ARCHITECTURE},
        vision=parse_vision_config(raw.get("vision_config") or {}),
        tokens_per_image=raw.get("mm_tokens_per_image", 256),
        boi_token_id=raw.get("boi_token_index", 255_999),
        eoi_token_id=raw.get("eoi_token_index", 256_000),
        image_token_id=raw.get("image_token_index", 262_144),
    )


@dataclass
class StepImages:
    """A step's image soft tokens: which rows of the flat batch they replace, and with what."""

    rows: torch.Tensor  # [num_image_tokens] int64
    embeddings: torch.Tensor  # [num_image_tokens, hidden] in the model's dtype


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__(config)
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = Gemma3Projector(
            config.vision, config.hidden_size, config.tokens_per_image
        )

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, 3, size, size] -> soft tokens [num_images, tokens_per_image, hidden]."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def forward(
        self, input_ids, positions, meta: StepAttention, images: StepImages | None = None
    ) -> torch.Tensor:
        if images is None:
            return super().forward(input_ids, positions, meta)
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary.lookup(positions, dtype)
        local_rope = self.local_rotary.lookup(positions, dtype)
        embeddings = self.model.embed(input_ids)
        embeddings[images.rows] = images.embeddings.to(dtype)
        return self.model(input_ids, cos, sin, meta, local_rope, embeddings=embeddings)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name -> ours. transformers saves the text model under
        `language_model.model.` (older files: `model.language_model.`), the tower under
        `vision_tower.` with or without `vision_model.`."""
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return None if self.config.tie_word_embeddings else "lm_head.weight"
        for prefix in (
            "model.vision_tower.vision_model.",
            "vision_tower.vision_model.",
            "model.vision_tower.",
            "vision_tower.",
        ):
            if name.startswith(prefix):
                rest = name.removeprefix(prefix)
                # transformers computes the pooling head and Gemma 3 never reads it.
                return None if rest.startswith("head.") else "vision_tower." + _tower_name(rest)
        for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
            if name.startswith(prefix):
                rest = name.removeprefix(prefix).replace(
                    "mm_soft_emb_norm.weight", "mm_soft_emb_norm_weight"
                )
                return "multi_modal_projector." + rest
        return name


# transformers' SigLIP names -> ours (the tower's q/k/v stay apart from the decoder's
# fused qkv_proj, which the loader fills from `q_proj`/`k_proj`/`v_proj`).
_TOWER_RENAMES = (
    ("embeddings.patch_embedding.", "patch_embedding."),
    ("embeddings.position_embedding.", "position_embedding."),
    ("encoder.layers.", "layers."),
    (".self_attn.q_proj.", ".self_attn.query."),
    (".self_attn.k_proj.", ".self_attn.key."),
    (".self_attn.v_proj.", ".self_attn.value."),
    (".mlp.fc1.", ".fc1."),
    (".mlp.fc2.", ".fc2."),
)


def _tower_name(name: str) -> str:
    for theirs, ours in _TOWER_RENAMES:
        name = name.replace(theirs, ours)
    return name


# transformers' Gemma3Config (the outer one), field by field; text_config and
# vision_config are checked against their own tables in parse_config.
CONFIG_FIELDS = declare(
    handled={
        "text_config",
        "vision_config",
        "mm_tokens_per_image",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "tie_word_embeddings",
    },
    harmless={
        "initializer_range": "initialises weights for training; the checkpoint replaces them",
        "use_cache": "transformers' own KV cache; tokenmill keeps its paged one",
        "pad_token_id": "a tokenizer id; padding never reaches the forward pass here",
        "bos_token_id": "the text model's (text_config) is the one read",
        "eos_token_id": "the text model's (text_config) is the one read",
    },
)


register(
    Architecture(
        names=(ARCHITECTURE,),
        model_class=Gemma3ForConditionalGeneration,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("gemma3",),
        tasks=("generate",),
    )
)
