"""Which layout a vision model's images have in prompt text: a fixed block per image
(Gemma 3: `image_prompts.ImageLayout`, and its crops' blocks with pan-and-scan) or one as
long as each image's size makes it (Qwen2.5-VL, Qwen2-VL: `qwen_image_prompts.DynamicLayout`).
A job's planner expands its rows' images with it, so their token counts are exact before
any pixel is decoded."""

from __future__ import annotations

from pathlib import Path

from tokenmill.engine.api.image_prompts import ImageLayout, fixed_layout
from tokenmill.engine.api.qwen_image_prompts import DynamicLayout, dynamic_layout
from tokenmill.engine.loader.images import ImageProcessor
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import ModelConfig, load_config
from tokenmill.engine.types.config import EngineConfig


def image_layout(
    model_dir: str | Path,
    tokenizer: Tokenizer,
    *,
    pan_and_scan: bool | None = EngineConfig.pan_and_scan,
) -> ImageLayout | DynamicLayout | None:
    """The image layout of the model in `model_dir` (None: it has no vision tower): a
    fixed block per image (Gemma 3; with pan-and-scan - the engine setting, None: as the
    model's image-processor config says - a block per crop too), or one as long as each
    image's size makes it (Qwen2.5-VL, Qwen2-VL: `DynamicLayout`).

    Raises:
        ValueError: a vision model whose tokenizer has no image marker tokens, or whose
            image-processor config is missing or not understood; pan_and_scan for a
            model without it (`check_pan_and_scan`).
    """
    config = load_config(model_dir)
    check_pan_and_scan(config, pan_and_scan)
    if getattr(config, "vision", None) is None:
        return None
    if hasattr(config, "mrope_section"):
        return dynamic_layout(model_dir, config, tokenizer)
    processor = ImageProcessor.from_dir(model_dir, pan_and_scan=pan_and_scan)
    return fixed_layout(config, tokenizer, processor.pan_and_scan)


def check_pan_and_scan(config: ModelConfig, pan_and_scan: bool | None) -> None:
    """Raises ValueError when pan_and_scan is asked of a model that has none: a text model,
    or one whose images take their own sizes (Qwen2.5-VL, Qwen2-VL)."""
    if not pan_and_scan:
        return
    if getattr(config, "vision", None) is None:
        raise ValueError(
            "pan_and_scan is set, but the model has no vision tower: it takes no images"
        )
    if hasattr(config, "mrope_section"):
        raise ValueError(
            "pan_and_scan is set, but this model's image processor (Qwen2-VL's dynamic "
            "resolution: each image at its own size) has no pan-and-scan; it is Gemma 3's"
        )
