"""Qwen2-VL (Qwen2VLForConditionalGeneration): Qwen2.5-VL's predecessor, run by the same
model (qwen2_5_vl.py: the Qwen2 text model with M-RoPE, image tokens at the image_pad
markers). Its vision tower differs in three ways the tower's config switches
(qwen2_5_vision.py): LayerNorms, an fc1 -> quick-GELU -> fc2 MLP, and no windows.

Its vision_config names the tower's width `embed_dim` and the text model's `hidden_size`
(the merger's output), and sizes the MLP as `mlp_ratio` times the width.
"""

from __future__ import annotations

from tokenmill.engine.models.config_fields import declare
from tokenmill.engine.models.qwen2_5_vision import QwenVisionConfig
from tokenmill.engine.models.qwen2_5_vl import (
    CONFIG_FIELDS,
    Qwen2_5_VLForConditionalGeneration,
    QwenVLConfig,
    parse_vl_config,
)
from tokenmill.engine.models.registry import Architecture, register

ARCHITECTURE = "Qwen2VLForConditionalGeneration"

# transformers' Qwen2VLVisionConfig, field by field.
VISION_CONFIG_FIELDS = declare(
    handled={
        "depth",
        "embed_dim",
        "hidden_size",
        "hidden_act",
        "mlp_ratio",
        "num_heads",
        "in_channels",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "rope_parameters",
    },
    harmless={
        "initializer_range": "initialises weights for training; the checkpoint replaces them",
    },
)


def parse_vision_config(raw: dict) -> QwenVisionConfig:
    VISION_CONFIG_FIELDS.check(raw, f"{ARCHITECTURE} vision_config")
    act = raw.get("hidden_act", "quick_gelu")
    if act != "quick_gelu":
        raise ValueError(f"{ARCHITECTURE}: vision_config.hidden_act {act!r} is not supported")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"{ARCHITECTURE}: vision_config rope_type {rope['rope_type']!r} is not supported "
            "(the tower's rope is 'axial')"
        )
    width = raw.get("embed_dim", 1280)
    depth = raw.get("depth", 32)
    return QwenVisionConfig(
        depth=depth,
        hidden_size=width,
        intermediate_size=int(width * raw.get("mlp_ratio", 4)),
        num_heads=raw.get("num_heads", 16),
        in_channels=raw.get("in_channels", 3),
        patch_size=raw.get("patch_size", 14),
        spatial_merge_size=raw.get("spatial_merge_size", 2),
        temporal_patch_size=raw.get("temporal_patch_size", 2),
        window_size=None,
        out_hidden_size=raw.get("hidden_size", 3584),
        fullatt_block_indexes=tuple(range(depth)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        layer_norm=True,
        gated_mlp=False,
    )


def parse_config(raw: dict) -> QwenVLConfig:
    """The nested config.json of Qwen2VLForConditionalGeneration."""
    return parse_vl_config(raw, ARCHITECTURE, parse_vision_config)


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    pass


register(
    Architecture(
        names=(ARCHITECTURE,),
        model_class=Qwen2VLForConditionalGeneration,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("qwen2_vl",),
        tasks=("generate",),
    )
)
