"""Prompts with images, as vLLM takes them: `{"prompt": str | "prompt_token_ids": [...],
"multi_modal_data": {"image": image or [images]}}`, an image being encoded bytes or a
PIL image.

Each image is placed where the prompt puts the model's begin-of-image marker, in order.
A text prompt is expanded as transformers' Gemma 3 processor expands it before
tokenizing: the marker becomes "\\n\\n" + marker + one image token per soft token +
end-of-image marker + "\\n\\n" - only those markers are encoded as control tokens,
any other special-token text stays data. A token-id prompt's marker id is followed by
the image tokens and the end marker (no newlines: the caller chose the ids).

With pan-and-scan (loader/pan_and_scan.py) an image with crops is shown as the image and
each crop, as transformers' processor writes it: "Here is the original image" + block +
" and here are some crops to help you see better" + one block per crop, each block one
ImageSpan keyed by the image's content hash and the crop's box. A token-id prompt must
hold every block of such an image itself (the text between them is the processor's).

A bad image (corrupt, truncated, unsupported, over the pixel limit) or a marker count
that does not match the images makes that prompt an error, never a prompt run without
its image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.core.image_prefetch import LazyPixels
from tokenmill.engine.core.images import ImageSpan
from tokenmill.engine.loader.images import (
    ImageError,
    ImageProcessor,
    content_hash,
    decode_image,
    image_size,
    to_decoded,
)
from tokenmill.engine.loader.pan_and_scan import Box, PanAndScan
from tokenmill.engine.loader.special_text import Spans
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.types.config import EngineConfig

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})


@dataclass
class PreparedPrompt:
    """A prompt ready to queue: its token ids and images, or why it cannot run."""

    token_ids: list[int]
    images: tuple[ImageSpan, ...] = ()
    text: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ImageSource:
    """What a prompt's image is known by before it is decoded."""

    content_hash: bytes
    size: tuple[int, int]  # (width, height) of its decoded pixels
    pixels: torch.Tensor | LazyPixels


def is_image_prompt(prompt: Any) -> bool:
    return isinstance(prompt, dict)


def check_prompt_dict(prompt: dict, has_vision: bool) -> None:
    """Raises ValueError (TypeError for a wrong type) naming what a prompt dict gets wrong,
    before anything is queued."""
    unknown = sorted(set(prompt) - PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict has unknown keys {unknown}; keys: {sorted(PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(
            f"multi_modal_data takes only 'image', got {sorted(data) if isinstance(data, dict) else data!r}"
        )
    if data and not has_vision:
        raise ValueError("this model has no vision tower: it cannot take images (multi_modal_data)")


@dataclass(frozen=True)
class ImageLayout:
    """Where a vision model's images sit in prompt text: a prompt places each image with
    the begin-of-image marker, which `expand` turns into the image's whole block of soft
    tokens as transformers' processor does - so a planner counts (and a job stores) the
    prompt's tokens exactly, images included, before any image is decoded."""

    marker: str  # the begin-of-image marker's text
    block: str  # what the marker expands to: markers and one image token per soft token
    tokens_per_image: int
    image_token_id: int  # the id each of an image's soft tokens is in a prompt
    # How images are cropped (None: each is shown whole, one block): an image with crops
    # expands to the text transformers' processor writes around its blocks.
    pan_and_scan: PanAndScan | None = None

    @property
    def placeholder(self) -> str:
        """What places one image in text that places none itself."""
        return self.marker

    def image_text(self, width: int, height: int) -> str:
        """What the marker of an image of this size expands to."""
        crops = 0 if self.pan_and_scan is None else self.pan_and_scan.num_crops(width, height)
        if not crops:
            return self.block
        return (
            f"Here is the original image {self.block} and here are some crops to help you "
            "see better " + " ".join([self.block] * crops)
        )

    def count(self, text: str, data_spans: Spans = ()) -> int:
        """The images `text` places (markers outside the data spans)."""
        return sum(1 for _ in self._places(text, data_spans))

    def expand(
        self, text: str, data_spans: Spans = (), sizes: Sequence[tuple[int, int]] = ()
    ) -> tuple[str, Spans]:
        """`text` with each marker outside the data spans expanded, and the data spans
        moved with the text. Without pan-and-scan every image is the same block, whatever
        its size; with it, the i-th marker's image is `sizes[i]` ((width, height)).

        Raises:
            ValueError: with pan-and-scan, not one size per marker.
        """
        pieces, spans = [], []
        data = sorted(data_spans)
        places = list(self._places(text, data))
        if self.pan_and_scan is None:
            blocks = [self.block] * len(places)
        elif len(places) != len(sizes):
            raise ValueError(f"the prompt places {len(places)} image(s), {len(sizes)} sizes given")
        else:
            blocks = [self.image_text(width, height) for width, height in sizes]
        last = shift = 0
        for at, block in zip(places, blocks):
            pieces += [text[last:at], block]
            spans += [(s + shift, e + shift) for s, e in data if last <= s < at]
            shift += len(block) - len(self.marker)
            last = at + len(self.marker)
        pieces.append(text[last:])
        spans += [(s + shift, e + shift) for s, e in data if s >= last]
        return "".join(pieces), tuple(spans)

    def _places(self, text: str, data_spans: Spans):
        at = text.find(self.marker)
        while at != -1:
            if not any(start <= at < end for start, end in data_spans):
                yield at
            at = text.find(self.marker, at + len(self.marker))


def fixed_layout(
    config: ModelConfig, tokenizer: Tokenizer | None, crops: PanAndScan | None = None
) -> ImageLayout:
    """The ImageLayout of a model whose images are a fixed number of tokens each (Gemma
    3), cropped as `crops` says if given (pan-and-scan)."""
    if tokenizer is None:
        raise ValueError("a text prompt with images needs the model's tokenizer")
    backend = tokenizer.backend
    ids = (config.boi_token_id, config.eoi_token_id, config.image_token_id)
    markers = tuple(backend.id_to_token(i) for i in ids)
    if None in markers:
        raise ValueError("the tokenizer has no image marker tokens; pass prompt_token_ids")
    boi, eoi, image = markers
    n = config.tokens_per_image
    block = f"\n\n{boi}{image * n}{eoi}\n\n"
    return ImageLayout(boi, block, n, config.image_token_id, crops)


class ImagePrompts:
    """Turns prompt dicts into token ids and image spans for one vision model."""

    # Whether an image's token count follows from its size (not for a fixed-size tower).
    tokens_depend_on_size = False
    # How images are cropped (Gemma 3's pan-and-scan; None: never).
    pan_and_scan: PanAndScan | None = None

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        *,
        max_image_pixels: int = EngineConfig.max_image_pixels,
        pan_and_scan: bool | None = EngineConfig.pan_and_scan,
    ) -> None:
        self.processor = ImageProcessor.from_dir(model_dir, pan_and_scan=pan_and_scan)
        self.pan_and_scan = self.processor.pan_and_scan
        # With pan-and-scan an image's crops, and so its tokens, follow from its size.
        self.tokens_depend_on_size = self.pan_and_scan is not None
        vision = config.vision
        if (self.processor.height, self.processor.width) != (vision.image_size,) * 2:
            raise ValueError(
                f"preprocessor_config.json resizes to {self.processor.height}x"
                f"{self.processor.width}; the vision tower takes {vision.image_size} px"
            )
        self.tokenizer = tokenizer
        self.tokens_per_image = config.tokens_per_image
        self.boi, self.eoi, self.image = (
            config.boi_token_id,
            config.eoi_token_id,
            config.image_token_id,
        )
        self.max_image_pixels = max_image_pixels
        self.config = config
        self._layout: ImageLayout | None = None

    def prepare(self, prompt: dict, *, allow_special_tokens: bool = False) -> PreparedPrompt:
        """A prompt dict (checked by `check_prompt_dict`) -> its ids and images."""
        raw = (prompt.get("multi_modal_data") or {}).get("image", [])
        raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
        text = prompt.get("prompt")
        if text is None:
            return self._prepare(raw, ids=self._expand_ids(list(prompt["prompt_token_ids"])))
        spans: Spans = ()
        if not allow_special_tokens:  # the prompt is data, but for its image markers
            markers = self._marker_strings()
            spans = tuple(
                (start, end)
                for start, end in self._special_text().find(text)
                if text[start:end] not in markers
            )
        return self._prepare(raw, text=text, data_spans=spans)

    def prepare_rendered(self, text: str, data_spans: Spans, images: list) -> PreparedPrompt:
        """A chat template's output (its data spans as `Tokenizer.render_chat` gives
        them) and the conversation's images, in order. The template already wrote any
        BOS, so the tokenizer adds none (as for text-only chat)."""
        return self._prepare(images, text=text, data_spans=data_spans, add_special_tokens=False)

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
        except ImageError as exc:
            return PreparedPrompt([], text=text, error=f"image: {exc}")
        places_error = (
            f"the prompt places {{}} image(s) (begin-of-image markers) but {len(decoded)} "
            "were given"
        )
        if ids is None:
            if self.pan_and_scan is not None:  # a marker's text depends on its image's size
                placed = self.layout().count(text, data_spans)
                if placed != len(decoded):
                    return PreparedPrompt([], text=text, error=places_error.format(placed))
            sizes = [image.size for image in decoded]
            ids = self._encode_text(text, data_spans, add_special_tokens, sizes)
        spans = self._spans(ids)
        if ids.count(self.image) != len(spans) * self.tokens_per_image:
            return PreparedPrompt(
                ids, text=text, error="the prompt holds image tokens outside an image's place"
            )
        # Each image's boxes: the whole image (None), then its pan-and-scan crops.
        views = [[None, *self.processor.boxes(*image.size)] for image in decoded]
        num_views = sum(map(len, views))
        if len(spans) != num_views:
            if num_views == len(decoded):
                return PreparedPrompt(ids, text=text, error=places_error.format(len(spans)))
            return PreparedPrompt(
                ids,
                text=text,
                error=(
                    f"pan-and-scan shows the {len(decoded)} image(s) given as {num_views} "
                    f"(each and its crops), but the prompt places {len(spans)}: token ids "
                    "must hold each crop's image block (a text prompt is expanded so)"
                ),
            )
        offsets = iter(spans)
        images = tuple(
            ImageSpan(
                next(offsets),
                self.tokens_per_image,
                view_hash(image.content_hash, box),
                image.pixels,
                self._view_prepare(index),
            )
            for image, boxes in zip(decoded, views)
            for index, box in enumerate(boxes)
        )
        return PreparedPrompt(ids, images, text)

    def _view_prepare(self, index: int):
        """What makes the tower's input of an image's view `index` from its pixels: with
        pan-and-scan those are every view of it, stacked (`ImageProcessor.views`)."""
        if self.pan_and_scan is None:
            return self.processor.normalize
        normalize = self.processor.normalize
        return lambda views: normalize(views[index])

    def _source(self, image) -> ImageSource:
        """An image as a queued request holds it. Encoded bytes are checked from their
        header and decoded later, beside the engine (core/image_prefetch.py); a PIL image,
        already in memory, is resized now."""
        # With pan-and-scan an image's pixels are every view of it, made in one decode.
        resize = self.processor.resize if self.pan_and_scan is None else self.processor.views
        if not isinstance(image, (bytes, bytearray, memoryview)):
            decoded = to_decoded(image, max_pixels=self.max_image_pixels)
            return ImageSource(decoded.content_hash, decoded.size, resize(decoded))
        data = bytes(image)
        size = image_size(data, max_pixels=self.max_image_pixels)
        max_pixels = self.max_image_pixels
        sized = self.tokens_depend_on_size

        def load() -> torch.Tensor:
            decoded = decode_image(data, max_pixels=max_pixels)
            if sized and decoded.size != size:  # its token count was set from this size
                raise ImageError(
                    f"image decodes to {decoded.size[0]}x{decoded.size[1]}, its header "
                    f"says {size[0]}x{size[1]}"
                )
            return resize(decoded)

        return ImageSource(content_hash(data), size, LazyPixels(load))

    def _expand_ids(self, ids: list[int]) -> list[int]:
        """Each begin-of-image marker followed by its image tokens and end marker; a marker
        already followed by them (ids a planner expanded with `ImageLayout`) stays as is."""
        out: list[int] = []
        n = self.tokens_per_image
        for i, token in enumerate(ids):
            out.append(token)
            if token == self.boi and ids[i + 1 : i + 1 + n] != [self.image] * n:
                out += [self.image] * n + [self.eoi]
        return out

    def _special_text(self):
        if self.tokenizer is None:
            raise ValueError("a text prompt with images needs the model's tokenizer")
        return self.tokenizer.special_text

    def _marker_strings(self) -> tuple[str, str, str]:
        if self.tokenizer is None:
            raise ValueError("a text prompt with images needs the model's tokenizer")
        backend = self.tokenizer.backend
        markers = tuple(backend.id_to_token(i) for i in (self.boi, self.eoi, self.image))
        if None in markers:
            raise ValueError("the tokenizer has no image marker tokens; pass prompt_token_ids")
        return markers

    def _encode_text(
        self,
        text: str,
        data_spans: Spans,
        add_special_tokens: bool,
        sizes: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Expand each begin-of-image marker outside the data spans, as transformers'
        processor does for images of these sizes, then encode (the data spans moved with
        the text)."""
        text, spans = self.layout().expand(text, data_spans, sizes)
        return self.tokenizer.encode_batch([text], add_special_tokens, data_spans=[spans])[0]

    def layout(self) -> ImageLayout:
        """Where this model's images sit in prompt text (its marker strings)."""
        if self._layout is None:
            self._layout = fixed_layout(self.config, self.tokenizer, self.pan_and_scan)
        return self._layout

    def _spans(self, ids: Sequence[int]) -> list[int]:
        """The offset of each image's first soft token: every run of image tokens that
        follows a begin-of-image marker and is tokens_per_image long."""
        offsets = []
        n = self.tokens_per_image
        for i, token in enumerate(ids):
            if token == self.boi and ids[i + 1 : i + 1 + n] == [self.image] * n:
                offsets.append(i + 1)
        return offsets


def view_hash(image_hash: bytes, box: Box | None) -> bytes:
    """What keys the embeddings and KV blocks of an image's view: the image's own content
    hash for the whole image, and for a pan-and-scan crop that hash with the crop's box
    (the same image cropped alike is the same crop; cropped otherwise, another)."""
    if box is None:
        return image_hash
    digest = hashlib.blake2b(image_hash, digest_size=16)
    digest.update(b"pan-and-scan crop:%d,%d,%d,%d" % box)
    return digest.digest()


def image_url_bytes(url: Any) -> bytes:
    """The image of an OpenAI `image_url` part: a base64 `data:` URL's bytes.

    Raises:
        ImageError: another scheme (nothing is fetched), or data that is not base64.
    """
    if not isinstance(url, str):
        raise ImageError(f"image_url.url must be a string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        raise ImageError(
            f"image_url scheme {scheme or url[:20]!r} is not read: only base64 data: URLs "
            "are (nothing is fetched)"
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ImageError("a data: image URL must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ImageError(f"the data: URL is not valid base64: {exc}") from None


def split_image_parts(messages: list) -> tuple[list, list[bytes], str | None]:
    """A conversation with OpenAI content parts -> (its messages as chat templates take
    them: `{"type": "text", "text": ...}` and `{"type": "image"}` parts, its images in
    order, the error of a bad image part or None).

    Raises:
        ValueError: a content part of a type other than text and image_url.
    """
    out, images, error = [], [], None
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text")})
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url")
                try:
                    images.append(image_url_bytes(url))
                except ImageError as exc:
                    error = error or f"image: {exc}"
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"content part of type {kind!r}: the parts taken are text and image_url"
                )
        out.append({**message, "content": parts})
    return out, images, error


def has_image_parts(messages: list) -> bool:
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )
