"""Prompts with images for Qwen2.5-VL, as its transformers processor makes them.

An image's place in a prompt is one `<|image_pad|>` (usually between `<|vision_start|>`
and `<|vision_end|>`, as the chat template writes it); the processor repeats it once per
token the image becomes, which depends on the image's size (dynamic resolution:
loader/qwen_images.py). A text prompt's markers are expanded before tokenizing, only
those encoded as control tokens (any other special-token text stays data); a token-id
prompt's image_pad ids are expanded in place, one image each, in order.

The image's span is causal (bidirectional=False) and carries its token grid, from which
the text model's 3D positions follow (core/mrope.py). Token ids a planner already
expanded (`DynamicLayout`, from the images' header sizes) are taken as they are: each
run of image_pad ids is one image, of one id (to expand) or of the image's whole count.
A bad image, one of an aspect
ratio the processor refuses, or a marker count that does not match the images makes
that prompt an error, never a prompt run without its image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.api.image_prompts import ImagePrompts, PreparedPrompt
from tokenmill.engine.core.images import ImageSpan
from tokenmill.engine.loader.images import ImageError
from tokenmill.engine.loader.qwen_images import DynamicImageProcessor
from tokenmill.engine.loader.special_text import Spans
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.types.config import EngineConfig


@dataclass(frozen=True)
class DynamicLayout:
    """Where a dynamic-resolution model's images sit in prompt text: each image_pad
    marker becomes as many image_pad tokens as its image's size makes
    (`DynamicImageProcessor.num_tokens`), so a planner counts a prompt's tokens exactly
    from the images' header sizes, before any pixel is decoded."""

    marker: str  # <|image_pad|>
    placeholder: str  # <|vision_start|><|image_pad|><|vision_end|>, as the chat template
    processor: DynamicImageProcessor
    image_token_id: int

    def count(self, text: str, data_spans: Spans = ()) -> int:
        """The images `text` places (markers outside the data spans)."""
        return len(_markers_outside(text, self.marker, data_spans))

    def tokens(self, width: int, height: int) -> int:
        """The tokens an image of this size is in a prompt. The count is symmetric in
        width and height, so an EXIF rotation the header does not show changes nothing."""
        return self.processor.num_tokens(width, height)

    def expand(
        self, text: str, data_spans: Spans = (), sizes: Sequence[tuple[int, int]] = ()
    ) -> tuple[str, Spans]:
        """`text` with the i-th marker outside the data spans repeated once per token of
        the image of `sizes[i]` ((width, height)), and the data spans moved with it.

        Raises:
            ImageError: an image of an aspect ratio the processor refuses.
            ValueError: not one size per marker.
        """
        places = _markers_outside(text, self.marker, data_spans)
        if len(places) != len(sizes):
            raise ValueError(f"the prompt places {len(places)} image(s), {len(sizes)} sizes given")
        counts = [self.tokens(width, height) for width, height in sizes]
        return _repeat_markers(text, self.marker, data_spans, places, counts)


def dynamic_layout(model_dir: str | Path, config: ModelConfig, tokenizer: Tokenizer | None):
    """The DynamicLayout of the Qwen2.5-VL / Qwen2-VL model in `model_dir`.

    Raises:
        ValueError: no tokenizer, or one without the vision marker tokens; a missing or
            unsupported preprocessor_config.json.
    """
    if tokenizer is None:
        raise ValueError("a text prompt with images needs the model's tokenizer")
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    start, pad, end = (tokenizer.backend.id_to_token(i) for i in ids)
    if None in (start, pad, end):
        raise ValueError("the tokenizer has no image marker tokens; pass prompt_token_ids")
    processor = DynamicImageProcessor.from_dir(model_dir)
    return DynamicLayout(pad, f"{start}{pad}{end}", processor, config.image_token_id)


def _markers_outside(text: str, marker: str, data_spans: Spans) -> list[int]:
    """Where `marker` stands in text, outside the data spans."""
    found, at = [], text.find(marker)
    while at != -1:
        if not any(start <= at < end for start, end in data_spans):
            found.append(at)
        at = text.find(marker, at + len(marker))
    return found


def _repeat_markers(
    text: str, marker: str, data_spans: Spans, places: list[int], counts: list[int]
) -> tuple[str, Spans]:
    pieces, spans = [], []
    data = sorted(data_spans)
    last = shift = 0
    for at, count in zip(places, counts):
        block = marker * count
        pieces += [text[last:at], block]
        spans += [(s + shift, e + shift) for s, e in data if last <= s < at]
        shift += len(block) - len(marker)
        last = at + len(marker)
    pieces.append(text[last:])
    spans += [(s + shift, e + shift) for s, e in data if s >= last]
    return "".join(pieces), tuple(spans)


class QwenImagePrompts(ImagePrompts):
    """ImagePrompts for a dynamic-resolution model (Qwen2.5-VL): one image_pad marker per
    image, expanded to that image's token count."""

    tokens_depend_on_size = True

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        *,
        max_image_pixels: int = EngineConfig.max_image_pixels,
    ) -> None:
        self.processor = DynamicImageProcessor.from_dir(model_dir)
        vision = config.vision
        mine = (self.processor.patch_size, self.processor.merge_size)
        if mine != (vision.patch_size, vision.spatial_merge_size) or (
            self.processor.temporal_patch_size != vision.temporal_patch_size
        ):
            raise ValueError(
                f"preprocessor_config.json cuts {self.processor.patch_size} px patches merged "
                f"{self.processor.merge_size} x {self.processor.merge_size} over "
                f"{self.processor.temporal_patch_size} frames; the vision tower takes "
                f"{vision.patch_size} px merged {vision.spatial_merge_size} over "
                f"{vision.temporal_patch_size}"
            )
        self.tokenizer = tokenizer
        self.boi, self.eoi, self.image = (
            config.vision_start_token_id,
            config.vision_end_token_id,
            config.image_token_id,
        )
        self.max_image_pixels = max_image_pixels

    def _expand_ids(self, ids: list[int]) -> list[int]:
        """Token ids as given: each image's run is expanded in `_prepare`, once its
        size (and so its token count) is known."""
        return ids

    def _prepare(
        self,
        raw: list,
        *,
        ids: list[int] | None = None,
        text: str | None = None,
        data_spans=(),
        add_special_tokens: bool = True,
    ) -> PreparedPrompt:
        try:
            decoded = [self._source(i) for i in raw]
            counts = [self.processor.num_tokens(*image.size) for image in decoded]
        except ImageError as exc:
            return PreparedPrompt([], text=text, error=f"image: {exc}")
        if ids is None:
            places = len(self._markers_outside(text, data_spans))
        elif ids.count(self.image) == len(decoded) != len(self._runs(ids)):
            return PreparedPrompt(
                ids,
                text=text,
                error="the prompt holds image tokens outside an image's place (two image_pad "
                "ids side by side are one image's place)",
            )
        else:
            places = len(self._runs(ids))
        if places != len(decoded):
            return PreparedPrompt(
                ids or [],
                text=text,
                error=(
                    f"the prompt places {places} image(s) (image_pad markers) "
                    f"but {len(decoded)} were given"
                ),
            )
        if ids is None:
            ids = self._encode_expanded(text, data_spans, counts, add_special_tokens)
        else:
            ids = self._expand(ids, counts)
        # Each image's tokens must be one run of its own: two images side by side would
        # be one run, which transformers places as one image.
        offsets = [
            i
            for i, token in enumerate(ids)
            if token == self.image and (i == 0 or ids[i - 1] != self.image)
        ]
        if [self._run_length(ids, o) for o in offsets] != counts:
            return PreparedPrompt(
                ids, text=text, error="the prompt holds image tokens outside an image's place"
            )
        m = self.processor.merge_size
        images = []
        for offset, count, image in zip(offsets, counts, decoded):
            _, rows, columns = self.processor.grid(*image.size)
            images.append(
                ImageSpan(
                    offset,
                    count,
                    image.content_hash,
                    image.pixels,
                    self.processor.patches,
                    bidirectional=False,
                    grid=(rows // m, columns // m),
                )
            )
        return PreparedPrompt(ids, tuple(images), text)

    def _run_length(self, ids: list[int], offset: int) -> int:
        end = offset
        while end < len(ids) and ids[end] == self.image:
            end += 1
        return end - offset

    def _runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of each run of image_pad ids."""
        runs = []
        for i, token in enumerate(ids):
            if token == self.image and (i == 0 or ids[i - 1] != self.image):
                runs.append((i, self._run_length(ids, i)))
        return runs

    def _expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """Each run of image_pad ids is one image's place: one id becomes the image's
        count; a run already that long (a planner expanded it) stays. Any other run is
        left for the caller's check to refuse (two images side by side are one run,
        which transformers would place as one image)."""
        out: list[int] = []
        last = 0
        for (offset, length), count in zip(self._runs(ids), counts):
            out += ids[last:offset]
            out += [self.image] * (count if length == 1 else length)
            last = offset + length
        return out + ids[last:]

    def _markers_outside(self, text: str, data_spans: Spans) -> list[int]:
        """Where the image_pad marker stands in text, outside the data spans."""
        return _markers_outside(text, self._marker_strings()[2], data_spans)

    def _encode_expanded(
        self, text: str, data_spans: Spans, counts: list[int], add_special_tokens: bool
    ) -> list[int]:
        """Repeat each image_pad marker outside the data spans once per token of its
        image, as transformers' processor does, then encode (the data spans moved with
        the text)."""
        marker = self._marker_strings()[2]
        places = self._markers_outside(text, data_spans)
        text, spans = _repeat_markers(text, marker, data_spans, places, counts)
        return self.tokenizer.encode_batch([text], add_special_tokens, data_spans=[spans])[0]
