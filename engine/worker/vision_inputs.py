"""A step's images, for a model with a vision tower: which rows of the flat batch are
image soft tokens and what replaces their embeddings, and - for a model whose image
tokens see each other both ways (Gemma 3) - the attention that lets them
(attention/image_spans.py). A causal model's image (Qwen2.5-VL) may be split across
chunks: each chunk takes the slice of its tokens it computes.

The tower runs once per step over the images the step needs that are not already
encoded, batched (in groups of `max_images_per_batch`). Encoded images are kept by
content hash (most recently used first, `max_cached_images` of them), so an image
shared by many rows - or a prompt recomputed after preemption - is encoded once.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from tokenmill.engine.core.image_prefetch import release_pixels
from tokenmill.engine.core.step import SchedulerOutput
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.gemma3_vision import StepImages
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.worker.attention.backend import upload
from tokenmill.engine.worker.attention.image_spans import ImageRows, ImageSpanAttention


class VisionInputs:
    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        pair_layout: bool,
        max_cached_images: int = 64,
        max_images_per_batch: int = 8,
        max_image_tokens_per_batch: int = 16_384,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.pair_layout = pair_layout
        self.max_cached_images = max_cached_images
        # Images per tower call: a tower's activations grow with it (at Gemma 3's shape an
        # image is 4,096 patches), so a step with many images runs it in groups.
        self.max_images_per_batch = max_images_per_batch
        # And at most this many image tokens, for towers that take images at their own
        # sizes (Qwen2.5-VL: up to 16,384 tokens, 65,536 patches, an image by default);
        # a call always takes at least one image.
        self.max_image_tokens_per_batch = max_image_tokens_per_batch
        self._encoded: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_images_encoded = 0  # tower runs, counted per image
        self.num_tower_calls = 0

    def step(
        self, out: SchedulerOutput, meta: StepAttention, profiler: StepProfiler = NO_PROFILER
    ) -> tuple[StepAttention, StepImages | None]:
        """(the attention the step's layers use, its image tokens) - the meta and None
        when no chunk of the step computes an image token. The tower's inputs are made
        in the profiler's "images" stage and the tower runs in its "vision" stage."""
        # Rows as the runner flattens them (ModelRunner.step_tokens): decodes, then prefills.
        # (row of the image's first token this step, its tokens computed before this
        # step, its tokens this step computes, image)
        placed: list[tuple[int, int, int, object]] = []
        spans: list[ImageRows] = []
        row = 0
        for chunk in [*out.decodes, *out.prefills]:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            for image in seq.images:
                if image.end <= start or image.offset >= end:
                    continue
                first = max(image.offset, start)
                last = min(image.end, end)
                placed.append((row + first - start, first - image.offset, last - first, image))
                if not image.bidirectional:  # attended causally, as text: no second pass
                    continue
                if image.end > end:
                    raise RuntimeError("a prefill chunk ends inside an image")
                blocks = None
                if start:
                    ids = seq.block_table[: -(-start // self.block_size)]
                    blocks = upload(np.asarray(ids), self.device)
                spans.append(
                    ImageRows(
                        first_row=row + first - start,
                        first_position=first,
                        num_rows=image.end - first,
                        image_offset=image.offset,
                        image_end=image.end,
                        chunk_row=row,
                        chunk_position=start,
                        context_blocks=blocks,
                    )
                )
            row += chunk.num_new_tokens
        if not placed:
            return meta, None
        self._encode([image for *_, image in placed], profiler)
        rows, embeddings = [], []
        for first_row, skip, count, image in placed:
            rows.append(np.arange(first_row, first_row + count))
            embeddings.append(self._encoded[image.content_hash][skip : skip + count])
        images = StepImages(
            rows=upload(np.concatenate(rows), self.device), embeddings=torch.cat(embeddings)
        )
        if spans:
            meta = ImageSpanAttention(meta, spans, self.pair_layout)
        return meta, images

    def _encode(self, images: list, profiler: StepProfiler = NO_PROFILER) -> None:
        """Run the tower over those of `images` not already encoded, in as few calls as
        the per-call bounds allow."""
        todo = {}
        for image in images:
            if image.content_hash in self._encoded:
                self._encoded.move_to_end(image.content_hash, last=False)
            else:
                todo.setdefault(image.content_hash, image)
        for group in self._groups(list(todo.items())):
            self.num_tower_calls += 1
            own_sizes = hasattr(self.model, "encode_image_list")  # images of their own sizes
            # Normalising (and patching) the decoded pixels, apart from the tower's time.
            with profiler.stage("images"):
                if own_sizes:
                    pixels = [image.pixel_values.to(self.device) for _, image in group]
                else:
                    pixels = torch.stack([image.pixel_values for _, image in group])
                    pixels = pixels.to(self.device, self.dtype)
            with profiler.stage("vision"):
                if own_sizes:
                    encoded = self.model.encode_image_list(pixels, [i.grid for _, i in group])
                else:
                    encoded = self.model.encode_images(pixels)
            self.num_images_encoded += len(group)
            for (content_hash, _), tokens in zip(group, encoded):
                self._encoded[content_hash] = tokens
                self._encoded.move_to_end(content_hash, last=False)
        # Encoded (or already cached): their decoded pixels are no longer needed.
        release_pixels(images)
        keep = max(self.max_cached_images, len(images))
        while len(self._encoded) > keep:
            self._encoded.popitem(last=True)

    def _groups(self, pending: list) -> list[list]:
        """pending (content hash, image) in tower calls: at most max_images_per_batch
        images and max_image_tokens_per_batch tokens each, in order."""
        groups: list[list] = []
        tokens = 0
        for item in pending:
            length = item[1].length
            if (
                not groups
                or len(groups[-1]) == self.max_images_per_batch
                or tokens + length > self.max_image_tokens_per_batch
            ):
                groups.append([])
                tokens = 0
            groups[-1].append(item)
            tokens += length
        return groups
