"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): the Qwen2 text model with 3D rotary
positions (M-RoPE), plus the dynamic-resolution vision tower (qwen2_5_vision.py) whose
tokens replace the embeddings of the prompt's image tokens.

As transformers computes it:
- an image of grid (1, h, w) patches becomes h * w / merge_size**2 tokens, placed at the
  prompt's `<|image_pad|>` ids, as the tower outputs them (no scale);
- the text model attends causally over image tokens as over text (no bidirectional
  span: a prefill chunk may split an image);
- each token has (time, row, column) positions (core/mrope.py); the rotary frequencies
  are split in `mrope_section` bands, the first rotated by the time position, the second
  by the row, the third by the column. A text token's three are equal, so its rotation
  is plain rope's at that position.

Videos are not supported (a video grid is refused by the tower).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.config_fields import declare
from tokenmill.engine.models.gemma3_vision import StepImages
from tokenmill.engine.models.llama import LlamaForCausalLM
from tokenmill.engine.models.qwen2 import CONFIG_FIELDS as TEXT_CONFIG_FIELDS
from tokenmill.engine.models.qwen2 import parse_config as parse_text_config
from tokenmill.engine.models.qwen2_5_vision import QwenVisionConfig, QwenVisionTower, tower_name
from tokenmill.engine.models.registry import Architecture, register

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# The text model's own fields (Qwen2's table, the base fields aside).
_TEXT_FIELDS = (
    TEXT_CONFIG_FIELDS.handled | set(TEXT_CONFIG_FIELDS.harmless) | set(TEXT_CONFIG_FIELDS.refused)
)


@dataclass
class QwenVLConfig(ModelConfig):
    """The text model's ModelConfig plus the tower, the M-RoPE bands and the image ids."""

    vision: QwenVisionConfig | None = None
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151_655  # <|image_pad|>, one per image token
    vision_start_token_id: int = 151_652  # <|vision_start|>
    vision_end_token_id: int = 151_653  # <|vision_end|>


# transformers' Qwen2_5_VLVisionConfig, field by field.
VISION_CONFIG_FIELDS = declare(
    handled={
        "depth",
        "hidden_size",
        "hidden_act",
        "intermediate_size",
        "num_heads",
        "in_channels",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "window_size",
        "out_hidden_size",
        "fullatt_block_indexes",
        "rope_parameters",
    },
    harmless={
        "tokens_per_second": "spaces a video's time positions; images have one frame",
        "initializer_range": "initialises weights for training; the checkpoint replaces them",
    },
)


def parse_vision_config(raw: dict) -> QwenVisionConfig:
    VISION_CONFIG_FIELDS.check(raw, f"{ARCHITECTURE} vision_config")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{ARCHITECTURE}: vision_config.hidden_act {act!r} is not supported")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"{ARCHITECTURE}: vision_config rope_type {rope['rope_type']!r} is not supported "
            "(the tower's rope is 'axial')"
        )
    defaults = QwenVisionConfig()
    return QwenVisionConfig(
        depth=raw.get("depth", defaults.depth),
        hidden_size=raw.get("hidden_size", defaults.hidden_size),
        intermediate_size=raw.get("intermediate_size", defaults.intermediate_size),
        num_heads=raw.get("num_heads", defaults.num_heads),
        in_channels=raw.get("in_channels", defaults.in_channels),
        patch_size=raw.get("patch_size", defaults.patch_size),
        spatial_merge_size=raw.get("spatial_merge_size", defaults.spatial_merge_size),
        temporal_patch_size=raw.get("temporal_patch_size", defaults.temporal_patch_size),
        window_size=raw.get("window_size", defaults.window_size),
        out_hidden_size=raw.get("out_hidden_size", defaults.out_hidden_size),
        fullatt_block_indexes=tuple(
            raw.get("fullatt_block_indexes", defaults.fullatt_block_indexes)
        ),
        rope_theta=float(rope.get("rope_theta", defaults.rope_theta)),
    )


def _split_mrope(text_raw: dict, architecture: str) -> tuple[dict, tuple[int, ...]]:
    """The text config with its rope dict's M-RoPE keys taken out (what Qwen2's parser
    reads), and the mrope_section. transformers 5 writes `rope_parameters` with
    rope_type "default"; older files `rope_scaling` with type "mrope"."""
    text_raw = dict(text_raw)
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text_raw.get(key)
        if not isinstance(rope, dict):
            continue
        rope = dict(rope)
        section = rope.pop("mrope_section", section)
        if rope.pop("mrope_interleaved", False):
            raise ValueError(
                f"{architecture}: interleaved M-RoPE (mrope_interleaved) is not supported"
            )
        if rope.get("rope_type", rope.get("type")) == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text_raw[key] = rope
    return text_raw, tuple(section or (16, 24, 24))


def parse_config(raw: dict) -> QwenVLConfig:
    """The nested config.json of Qwen2_5_VLForConditionalGeneration (text_config and
    vision_config, each checked against its own field table)."""
    return parse_vl_config(raw, ARCHITECTURE, parse_vision_config)


def parse_vl_config(
    raw: dict, architecture: str, parse_vision: Callable[[dict], QwenVisionConfig]
) -> QwenVLConfig:
    """A Qwen-VL config.json: its text_config as Qwen2's with M-RoPE bands, its
    vision_config by `parse_vision`."""
    # As transformers: without a text_config (the layout transformers 4 wrote), the
    # text model's fields are the top level's; with one, the top level's are ignored.
    text_raw = raw.get("text_config")
    if text_raw is None:
        text_raw = {k: v for k, v in raw.items() if k in _TEXT_FIELDS}
    text_raw, section = _split_mrope(text_raw, architecture)
    text_raw["architectures"] = ["Qwen2ForCausalLM"]
    # Tied if either says so (transformers ties the outer config when the text one does).
    tied = bool(raw.get("tie_word_embeddings")) or bool(text_raw.get("tie_word_embeddings"))
    text_raw["tie_word_embeddings"] = tied
    TEXT_CONFIG_FIELDS.check(text_raw, f"{architecture} text_config")
    text = parse_text_config(text_raw)
    if text.rope_scaling is not None:
        raise ValueError(
            f"{architecture}: text rope scaling {text.rope_scaling['rope_type']!r} with "
            "M-RoPE is not supported"
        )
    if text.sliding_window is not None:
        raise ValueError(f"{architecture}: sliding-window attention is not supported")
    half = text.head_dim // 2
    if sum(section) != half:
        raise ValueError(
            f"{architecture}: mrope_section {list(section)} must add up to head_dim / 2 = {half}"
        )
    vision = parse_vision(raw.get("vision_config") or {})
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"{architecture}: vision out_hidden_size {vision.out_hidden_size} is not the text "
            f"model's hidden_size {text.hidden_size}"
        )
    base = {f: getattr(text, f) for f in text.__dataclass_fields__}
    return QwenVLConfig(
        **{**base, "architecture": architecture},
        vision=vision,
        mrope_section=section,
        image_token_id=raw.get("image_token_id", 151_655),
        vision_start_token_id=raw.get("vision_start_token_id", 151_652),
        vision_end_token_id=raw.get("vision_end_token_id", 151_653),
    )


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    # Positions are 3D (core/mrope.py): the runner passes them beside the token indices.
    uses_mrope = True

    def __init__(self, config: QwenVLConfig) -> None:
        super().__init__(config)
        self.visual = QwenVisionTower(config.vision)
        self.mrope_axis: torch.Tensor | None = None

    def attach_rotary(self, max_positions: int, device: torch.device) -> None:
        super().attach_rotary(max_positions, device)
        # The position (0 time, 1 row, 2 column) each rotary column turns by: the
        # frequencies in mrope_section bands, the same bands on both halves of a head.
        bands = torch.cat(
            [
                torch.full((n,), i % 3, dtype=torch.int64)
                for i, n in enumerate(self.config.mrope_section)
            ]
        )
        self.mrope_axis = torch.cat((bands, bands)).to(device)

    @torch.inference_mode()
    def encode_image_list(
        self, patches: list[torch.Tensor], grids: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Images' flattened patches and their token grids (rows, columns after the
        merger) -> each image's tokens [rows * columns, hidden], in one tower call."""
        m = self.visual.config.spatial_merge_size
        dtype = self.visual.patch_embed.proj.weight.dtype
        tokens = self.visual(
            torch.cat(patches).to(dtype), [(1, rows * m, columns * m) for rows, columns in grids]
        )
        return list(tokens.split([rows * columns for rows, columns in grids]))

    def mrope_tables(
        self, mrope_positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[3, num_tokens] positions -> cos, sin [num_tokens, 1, head_dim], each column
        from the table row of its band's position."""
        cos = self.rotary.cos[mrope_positions]  # [3, num_tokens, dim]
        sin = self.rotary.sin[mrope_positions]
        index = self.mrope_axis.view(1, 1, -1).expand(1, *cos.shape[1:])
        cos = cos.gather(0, index)[0]
        sin = sin.gather(0, index)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def forward(
        self,
        input_ids,
        positions,
        meta: StepAttention,
        images: StepImages | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """mrope_positions: [3, num_tokens] (core/mrope.py); None only for a step of text
        tokens whose three positions equal their index (no image before them)."""
        dtype = self.model.embed_tokens.weight.dtype
        if mrope_positions is None:
            cos, sin = self.rotary.lookup(positions, dtype)
        else:
            cos, sin = self.mrope_tables(mrope_positions, dtype)
        embeddings = None
        if images is not None:
            embeddings = self.model.embed_tokens(input_ids)
            embeddings[images.rows] = images.embeddings.to(dtype)
        return self.model(input_ids, cos, sin, meta, embeddings=embeddings)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name -> ours. transformers 5 saves the text model under
        `model.language_model.` and the tower under `model.visual.`; older files under
        `model.` and `visual.`."""
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return None if self.config.tie_word_embeddings else "lm_head.weight"
        for prefix in ("model.visual.", "visual."):
            if name.startswith(prefix):
                return "visual." + tower_name(name.removeprefix(prefix))
        return name


# transformers' Qwen2_5_VLConfig (the outer one), field by field; text_config and
# vision_config are checked against their own tables in parse_config. The text model's
# fields are handled at the top level too: a config without text_config (transformers
# 4's layout) keeps them there, and parse_config checks them against the text table.
_OUTER_HARMLESS = {
    "video_token_id": "videos are refused before a prompt is queued; the id is never read",
}
CONFIG_FIELDS = declare(
    handled={
        "text_config",
        "vision_config",
        "image_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "tie_word_embeddings",
    }
    | (_TEXT_FIELDS - set(_OUTER_HARMLESS)),
    harmless=_OUTER_HARMLESS,
)


register(
    Architecture(
        names=(ARCHITECTURE,),
        model_class=Qwen2_5_VLForConditionalGeneration,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("qwen2_5_vl",),
        tasks=("generate",),
    )
)
