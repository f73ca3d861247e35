"""Qwen2-VL / Qwen2.5-VL image preprocessing against transformers' default image
processor here (`Qwen2VLImageProcessorPil`: torchvision is not installed, so
`Qwen2VLImageProcessor` falls back to its PIL backend): the resized size, the grid
(image_grid_thw), the token count and the flattened patches within 1e-5."""

from __future__ import annotations

import io

import pytest
import torch
from vision_models import png_bytes

from tokenmill.engine.loader.images import ImageError, decode_image
from tokenmill.engine.loader.qwen_images import DynamicImageProcessor, smart_resize

# Small pixel bounds so a few-dozen-pixel image exercises both the up- and down-scaling
# branches of smart_resize (patch 4, merge 2: sides are multiples of 8).
SMALL = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}


def reference(**settings):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**settings)


def test_the_reference_processor_is_transformers_pil_backend():
    from transformers import AutoImageProcessor, Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

    with pytest.raises(ImportError):
        import torchvision  # noqa: F401
    assert type(Qwen2VLImageProcessor()) is Qwen2VLImageProcessorPil
    processor = AutoImageProcessor.from_pretrained(_saved(reference(**SMALL)))
    assert type(processor) is Qwen2VLImageProcessorPil


def _saved(processor) -> str:
    import tempfile

    out = tempfile.mkdtemp(prefix="qwen-vl-processor-")
    processor.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("width", "height", "mode", "fmt", "bounds"),
    [
        (50, 37, "RGB", "PNG", (8 * 8, 16 * 16 * 8)),  # rounded to multiples of 8
        (13, 90, "RGBA", "PNG", (8 * 8, 16 * 16 * 8)),  # tall and narrow
        (200, 150, "RGB", "JPEG", (8 * 8, 40 * 40)),  # over max_pixels: scaled down
        (9, 7, "L", "PNG", (24 * 24, 64 * 64)),  # under min_pixels: scaled up
        (64, 20, "P", "PNG", (8 * 8, 64 * 64)),
        (33, 21, "CMYK", "JPEG", (8 * 8, 64 * 64)),
        (48, 32, "RGB", "PNG", (8 * 8, 64 * 64)),  # already a multiple: not resized
    ],
)
def test_patches_equal_transformers_processor(width, height, mode, fmt, bounds):
    from PIL import Image
    from transformers.image_utils import load_image

    min_pixels, max_pixels = bounds
    hf = reference(**SMALL, min_pixels=min_pixels, max_pixels=max_pixels)
    ours = DynamicImageProcessor.from_config(hf.to_dict())
    assert (ours.min_pixels, ours.max_pixels) == bounds
    data = png_bytes(width, height, seed=width, mode=mode, fmt=fmt)
    want = hf(load_image(Image.open(io.BytesIO(data))), return_tensors="pt")
    got, grid = ours(decode_image(data))
    assert [list(grid)] == want["image_grid_thw"].tolist()
    assert ours.num_tokens(width, height) == grid[1] * grid[2] // 4
    assert got.shape == want["pixel_values"].shape
    torch.testing.assert_close(got, want["pixel_values"], atol=1e-5, rtol=0)


def test_default_settings_equal_transformers():
    """The defaults of a config that names none (patch 14, merge 2, 56*56 to 28*28*1280
    pixels, bicubic, CLIP mean and std) are transformers'."""
    from PIL import Image

    hf = reference()
    ours = DynamicImageProcessor.from_config({})
    data = png_bytes(90, 61, seed=3)
    want = hf(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")
    got, grid = ours(decode_image(data))
    assert [list(grid)] == want["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(got, want["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("height", "width"), [(37, 50), (1000, 30), (3, 500), (2000, 3000), (28, 28), (42, 42)]
)
def test_smart_resize_equals_transformers(height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )

    for bounds in [(56 * 56, 28 * 28 * 1280), (8 * 8, 40 * 40)]:
        assert smart_resize(height, width, 28, *bounds) == hf_smart_resize(
            height, width, 28, *bounds
        )


def test_min_max_pixels_override_size_as_in_transformers():
    raw = {"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 4000}
    processor = DynamicImageProcessor.from_config(raw)
    assert (processor.min_pixels, processor.max_pixels) == (100, 4000)
    hf = reference(size={"shortest_edge": 100, "longest_edge": 5000}, max_pixels=4000)
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (100, 4000)


def test_unsupported_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="do_resize false"):
        DynamicImageProcessor.from_config({"do_resize": False})
    with pytest.raises(ValueError, match="do_convert_rgb false"):
        DynamicImageProcessor.from_config({"do_convert_rgb": False})
    with pytest.raises(ValueError, match=r"unknown keys \['height'\]"):
        DynamicImageProcessor.from_config({"size": {"height": 5}})
    with pytest.raises(ValueError, match="min_pixels over max_pixels"):
        DynamicImageProcessor.from_config({"min_pixels": 100, "max_pixels": 10})
    with pytest.raises(ImageError, match="aspect ratio over 200"):
        DynamicImageProcessor.from_config({}).num_tokens(1000, 4)
