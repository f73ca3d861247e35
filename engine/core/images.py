"""Images in a sequence's prompt, as the loop sees them: where each one's soft tokens sit,
and the two rules they impose.

- A prefill chunk never ends inside an image whose tokens attend to each other
  bidirectionally (Gemma 3's): all of those still to compute run in one step
  (`fit_chunk`). A causal model's image (Qwen2.5-VL's) may be split like text.
- A KV block holding (part of) an image is identified by the image's content hash as well
  as by its token ids, which are the same placeholder id for every image
  (`block_image_key`); the block hash chain carries it to every later block, so the same
  image under the same prefix is a prefix-cache hit and another image never is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.engine.core.image_prefetch import LazyPixels


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt."""

    offset: int  # position of its first soft token
    length: int  # its soft tokens
    content_hash: bytes  # of the image's bytes (or pixels): keys its embeddings and KV blocks
    # The image resized to the tower's size, 8-bit (a quarter of its float pixels'
    # memory), or its encoded bytes decoded on demand (LazyPixels: core/image_prefetch.py,
    # so a waiting request holds no pixels); and what makes the tower's input of it.
    pixels: torch.Tensor | LazyPixels
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Whether its tokens see each other both ways (Gemma 3) or causally, as text (Qwen2.5-VL).
    bidirectional: bool = True
    # For a model with 3D rotary positions (M-RoPE, core/mrope.py): its tokens' rows and
    # columns (rows * columns == length); None for a model with 1D positions.
    grid: tuple[int, int] | None = None

    @property
    def pixel_values(self) -> torch.Tensor:
        """What the tower takes of it, as the model's image processor makes it: [3, height,
        width] float32 for a fixed-size tower, flattened patches for Qwen2.5-VL's."""
        pixels = self.pixels.get() if isinstance(self.pixels, LazyPixels) else self.pixels
        return pixels if self.prepare is None else self.prepare(pixels)

    @property
    def end(self) -> int:
        return self.offset + self.length


def fit_chunk(images: Sequence[ImageSpan], start: int, num_tokens: int) -> int:
    """The most tokens, at most num_tokens, a chunk from `start` may take without ending
    inside a bidirectional image (0: the image it starts in does not fit)."""
    end = start + num_tokens
    for image in images:
        if image.bidirectional and image.offset < end < image.end:
            return max(0, image.offset - start)
    return num_tokens


def block_image_key(images: Sequence[ImageSpan], first: int, last: int) -> bytes:
    """What, beyond token ids, identifies the KV block of positions [first, last): the
    content hash and offset of each image overlapping it (b"" when none does)."""
    parts = [
        b"%d:%s" % (image.offset, image.content_hash)
        for image in images
        if image.offset < last and image.end > first
    ]
    return b"|".join(parts)


def check_spans(images: Sequence[ImageSpan], num_tokens: int, max_chunk: int) -> str | None:
    """Why a prompt's image spans cannot be scheduled (None: they can)."""
    previous_end = 0
    for image in images:
        if image.offset < previous_end or image.end > num_tokens:
            return "image spans overlap or run past the prompt"
        if image.grid is not None and image.grid[0] * image.grid[1] != image.length:
            return "an image's grid does not hold its tokens"
        if image.bidirectional and image.length > max_chunk:
            return (
                f"an image takes {image.length} tokens, more than max_num_batched_tokens "
                f"({max_chunk}); an image's tokens are computed in one step"
            )
        previous_end = image.end
    return None
