"""Gemma 3's pan-and-scan: a wide or tall image is shown to the tower as itself and as a
row (or column) of crops, each resized to the tower's size, so detail a squeeze to one
square would lose is seen too.

The crops follow transformers' Gemma3ImageProcessor (`pan_and_scan`): an image whose
long side is at least `min_ratio_to_activate` times its short side is cut along its long
side into n crops, n the aspect ratio rounded half up, at most long side /
`min_crop_size`, then clamped to [2, `max_num_crops`]; each crop is ceil(side / n) long
(the last one what is left), and no crop is made when one would be shorter than
`min_crop_size` on either side. The count is a function of the image's width and height
and these settings alone, so a planner counts an image's tokens from its header.

Settings are read as transformers reads them: the model's image-processor config
(processor_config.json's "image_processor", else preprocessor_config.json) gives them
where it sets them (not null); Gemma3Processor's defaults fill the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Gemma3Processor's defaults for the settings a config leaves null (as Gemma 3's own do).
DEFAULT_MIN_CROP_SIZE = 256
DEFAULT_MAX_NUM_CROPS = 4
DEFAULT_MIN_RATIO_TO_ACTIVATE = 1.2

Box = tuple[int, int, int, int]  # (left, top, right, bottom) in the image's pixels


@dataclass(frozen=True)
class PanAndScan:
    """How a Gemma 3 image is cropped (see the module docstring)."""

    min_crop_size: int = DEFAULT_MIN_CROP_SIZE
    max_num_crops: int = DEFAULT_MAX_NUM_CROPS
    min_ratio_to_activate: float = DEFAULT_MIN_RATIO_TO_ACTIVATE

    def __post_init__(self) -> None:
        if self.min_crop_size < 1:
            raise ValueError(f"pan_and_scan_min_crop_size must be >= 1, got {self.min_crop_size}")
        # transformers clamps the count to at least 2 before the maximum, so a maximum
        # under 2 would make 1 or 0 crops of a size the rule never chose.
        if self.max_num_crops < 2:
            raise ValueError(f"pan_and_scan_max_num_crops must be >= 2, got {self.max_num_crops}")
        if not self.min_ratio_to_activate > 0:
            raise ValueError(
                f"pan_and_scan_min_ratio_to_activate must be > 0, got {self.min_ratio_to_activate}"
            )

    @classmethod
    def from_config(cls, raw: dict) -> PanAndScan:
        """The settings an image-processor config gives (null or absent: the default)."""

        def given(name: str, default, kind):
            value = raw.get(name)
            return default if value is None else kind(value)

        return cls(
            min_crop_size=given("pan_and_scan_min_crop_size", DEFAULT_MIN_CROP_SIZE, int),
            max_num_crops=given("pan_and_scan_max_num_crops", DEFAULT_MAX_NUM_CROPS, int),
            min_ratio_to_activate=given(
                "pan_and_scan_min_ratio_to_activate", DEFAULT_MIN_RATIO_TO_ACTIVATE, float
            ),
        )

    def boxes(self, width: int, height: int) -> list[Box]:
        """The crops of a width x height image, row by row (none: it is shown whole only)."""
        landscape = width >= height
        long, short = (width, height) if landscape else (height, width)
        if long / short < self.min_ratio_to_activate:
            return []
        count = int(math.floor(long / short + 0.5))  # the aspect ratio, half rounded up
        count = min(long // self.min_crop_size, count)
        count = min(self.max_num_crops, max(2, count))
        columns, rows = (count, 1) if landscape else (1, count)
        crop_width, crop_height = -(-width // columns), -(-height // rows)
        if min(crop_width, crop_height) < self.min_crop_size:
            return []
        # The last crop is what is left of the side (a slice past the edge stops there).
        return [
            (left, top, min(left + crop_width, width), min(top + crop_height, height))
            for top in range(0, rows * crop_height, crop_height)
            for left in range(0, columns * crop_width, crop_width)
        ]

    def num_crops(self, width: int, height: int) -> int:
        return len(self.boxes(width, height))
