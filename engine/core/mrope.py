"""Multimodal rotary positions (M-RoPE, Qwen2-VL and Qwen2.5-VL): each token has three
positions - time, row, column - and they are not token indices.

As transformers' `get_rope_index` computes them for a prompt of text and images:
- a text token's three positions are equal, one more than the previous token's largest;
- an image of rows x columns tokens starting where the next text token would (p) has
  time p, row p + r, column p + c for its token in row r, column c - so it advances the
  positions by max(rows, columns), not by its rows * columns tokens.

So a token's positions are a function of its index and the images before it (their
offsets and grids), which the sequence carries (core/images.py `ImageSpan.grid`). Every
token after the last image is at its index plus the sequence's `mrope_delta` (<= 0) -
transformers' `mrope_position_deltas` - which is how decode steps continue. A
recomputed prompt (after preemption) gets the same positions, and a prefix-cache block
is keyed by its images' content and offsets, which fix their grids: a cached block's
keys were rotated at the positions this sequence would give them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.engine.core.images import ImageSpan


def mrope_delta(images: Sequence[ImageSpan]) -> int:
    """Position minus index of every token after the sequence's last image."""
    return sum(max(image.grid) - image.length for image in images)


def mrope_positions(images: Sequence[ImageSpan], start: int, end: int) -> np.ndarray:
    """[3, end - start] int64: the (time, row, column) positions of tokens [start, end).

    Raises:
        ValueError: an image without a grid (a model with 1D positions made the span).
    """
    index = np.arange(start, end, dtype=np.int64)
    out = np.empty((3, end - start), dtype=np.int64)
    shift = 0  # position minus index of text after the images seen so far
    text_from = start
    for image in images:
        if image.grid is None:
            raise ValueError("an image without a grid in a sequence with 3D positions")
        if image.offset >= end:
            break
        # Text before this image.
        lo, hi = max(text_from, start), min(image.offset, end)
        if lo < hi:
            out[:, lo - start : hi - start] = index[lo - start : hi - start] + shift
        # The image's own tokens.
        lo, hi = max(image.offset, start), min(image.end, end)
        if lo < hi:
            first = image.offset + shift  # where the image starts: its time position
            local = index[lo - start : hi - start] - image.offset
            columns = image.grid[1]
            out[0, lo - start : hi - start] = first
            out[1, lo - start : hi - start] = first + local // columns
            out[2, lo - start : hi - start] = first + local % columns
        shift += max(image.grid) - image.length
        text_from = image.end
    lo = max(text_from, start)
    if lo < end:
        out[:, lo - start :] = index[lo - start :] + shift
    return out
