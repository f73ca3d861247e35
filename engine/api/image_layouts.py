"""Which layout a vision model's images have in prompt text: a fixed block per image
(Gemma 3: `image_prompts.ImageLayout`) or one as long as each image's size makes it
(Qwen2.5-VL, Qwen2-VL: `qwen_image_prompts.DynamicLayout`). A job's planner expands its
rows' images with it, so their token counts are exact before any pixel is decoded."""

from __future__ import annotations

from pathlib import Path

from tokenmill.engine.api.image_prompts import ImageLayout, fixed_layout
from tokenmill.engine.api.qwen_image_prompts import DynamicLayout, dynamic_layout
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import load_config


def image_layout(model_dir: str | Path, tokenizer: Tokenizer) -> ImageLayout | DynamicLayout | None:
    """The image layout of the model in `model_dir` (None: it has no vision tower): a
    fixed block per image (Gemma 3), or one as long as each image's size makes it
    (Qwen2.5-VL, Qwen2-VL: `DynamicLayout`).

    Raises:
        ValueError: a vision model whose tokenizer has no image marker tokens, or (dynamic
            resolution) whose preprocessor_config.json is missing or not understood.
    """
    config = load_config(model_dir)
    if getattr(config, "vision", None) is None:
        return None
    if hasattr(config, "mrope_section"):
        return dynamic_layout(model_dir, config, tokenizer)
    return fixed_layout(config, tokenizer)
