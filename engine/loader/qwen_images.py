"""Qwen2-VL / Qwen2.5-VL image preprocessing (dynamic resolution), as transformers'
`Qwen2VLImageProcessor` computes it, read from the model's preprocessor_config.json.

An image keeps (close to) its own size and aspect ratio instead of being squeezed to a
fixed square:
- its sides are rounded to multiples of `patch_size * merge_size` (28 px by default), then
  scaled as a whole to fit between min_pixels and max_pixels (`smart_resize`);
- it is resized with Pillow's filter on the 8-bit image, rescaled and normalised as every
  transformers PIL processor does (images.normalize_pixels);
- it is cut into patch_size x patch_size patches, each repeated `temporal_patch_size`
  times (an image is a one-frame video to the tower's 3D patch embedding), and flattened
  in the order the tower reads them: merge_size x merge_size groups of neighbouring
  patches are contiguous, since the tower's patch merger folds each group into one token.

So an image of grid (1, h, w) patches gives h * w rows of C * T * P * P values and
h * w / merge_size**2 tokens in the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tokenmill.engine.loader.images import (
    RESAMPLE_NAMES,
    DecodedImage,
    ImageError,
    image_processor_config,
    normalize_pixels,
)

# OpenAI CLIP's per-channel mean and std, transformers' defaults for this processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) -> the size a dynamic-resolution processor resizes to: both sides
    multiples of `factor`, the area within [min_pixels, max_pixels], the aspect ratio kept
    as closely as that allows. Raises ImageError for an aspect ratio over 200 (as
    transformers refuses it)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(
            f"image is {width}x{height}: an aspect ratio over 200 is refused by this processor"
        )
    # Python's round (half to even), as transformers rounds.
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


@dataclass(frozen=True)
class DynamicImageProcessor:
    """Qwen2-VL's image processor settings, read from preprocessor_config.json."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # PIL's BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_config(cls, raw: dict) -> DynamicImageProcessor:
        """Raises ValueError naming a setting it does not implement."""
        if raw.get("do_convert_rgb") is False:
            raise ValueError("preprocessor_config.json sets do_convert_rgb false; not supported")
        if raw.get("do_resize") is False:
            raise ValueError(
                "preprocessor_config.json sets do_resize false; images are always resized to "
                "multiples of patch_size * merge_size here"
            )
        # As transformers: `size` holds the pixel bounds, and min_pixels / max_pixels,
        # where given, override it.
        size = dict(raw.get("size") or {})
        unknown = set(size) - {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"}
        if unknown:
            raise ValueError(f"preprocessor_config.json size has unknown keys {sorted(unknown)}")
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        resample = int(raw.get("resample", 3))
        if resample not in RESAMPLE_NAMES:
            raise ValueError(f"preprocessor_config.json resample {resample} is not a PIL filter")
        processor = cls(
            min_pixels=int(min_pixels or cls.min_pixels),
            max_pixels=int(max_pixels or cls.max_pixels),
            patch_size=int(raw.get("patch_size", 14)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size", 2)),
            resample=resample,
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=tuple(float(m) for m in raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(s) for s in raw.get("image_std", CLIP_STD)),
        )
        if processor.min_pixels > processor.max_pixels:
            raise ValueError("preprocessor_config.json has min_pixels over max_pixels")
        return processor

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> DynamicImageProcessor:
        """The processor of the model in `model_dir` (`image_processor_config`)."""
        return cls.from_config(image_processor_config(model_dir))

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of."""
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of an image of this size after resizing."""
        new_height, new_width = smart_resize(
            height, width, self.factor, self.min_pixels, self.max_pixels
        )
        return new_width, new_height

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(frames, rows, columns) of patches of an image of this size: image_grid_thw."""
        new_width, new_height = self.resized_size(width, height)
        return 1, new_height // self.patch_size, new_width // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """The tokens an image of this size takes in a prompt (after the patch merger),
        known from its size alone."""
        _, rows, columns = self.grid(width, height)
        return rows * columns // self.merge_size**2

    def resize(self, image: DecodedImage) -> torch.Tensor:
        """-> the image resized as the processor resizes it, [height, width, 3] uint8."""
        new_width, new_height = self.resized_size(*image.size)
        pixels = image.pixels
        if (new_width, new_height) != image.size:
            resample = getattr(Image.Resampling, RESAMPLE_NAMES[self.resample])
            resized = Image.fromarray(pixels).resize((new_width, new_height), resample=resample)
            pixels = np.asarray(resized)
        if not pixels.flags.writeable:  # the decoded image's own buffer: keep it intact
            pixels = pixels.copy()
        return torch.from_numpy(np.ascontiguousarray(pixels))

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """A resized image [height, width, 3] uint8 -> its flattened patches
        [rows * columns, 3 * temporal_patch_size * patch_size**2] float32, merge groups
        contiguous (the tower's input for this image)."""
        values = normalize_pixels(pixels, self)  # [3, height, width]
        channels, height, width = values.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, columns = height // p, width // p
        grouped = values.view(channels, rows // m, m, p, columns // m, m, p)
        # -> (row group, column group, row in group, column in group, channel, py, px)
        grouped = grouped.permute(1, 4, 2, 5, 0, 3, 6)
        frames = grouped.unsqueeze(5).expand(*grouped.shape[:5], t, p, p)
        return frames.reshape(rows * columns, channels * t * p * p).contiguous()

    def __call__(self, image: DecodedImage) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """-> (flattened patches, image_grid_thw) as transformers' processor makes them."""
        return self.patches(self.resize(image)), self.grid(*image.size)
