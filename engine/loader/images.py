"""Images in: decoding bytes into RGB pixels, and preprocessing them as a model's
`preprocessor_config.json` says.

Decoding normalises an image as transformers' `load_image` does: EXIF orientation is
applied, then every colour mode (palette, CMYK, 16-bit grey, alpha) becomes 8-bit RGB by
Pillow's own conversion. An image larger than the pixel limit is refused before its
pixels are decoded (Pillow reads the size from the header), so a decompression bomb
costs nothing. Every failure is an `ImageError` whose message says what is wrong.

Preprocessing reproduces transformers' PIL image-processor backend (the one its
AutoImageProcessor uses where torchvision is not installed): resize to the model's fixed
size with Pillow's resampling filter on the uint8 image, rescale in float64 then round
to float32, normalise per channel in float32. With pan-and-scan (Gemma 3,
loader/pan_and_scan.py) a wide or tall image is the image and its crops, each resized so.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from tokenmill.engine.loader.pan_and_scan import Box, PanAndScan
from tokenmill.engine.types.config import DEFAULT_MAX_IMAGE_PIXELS, EngineConfig


class ImageError(ValueError):
    """An image that cannot be used: corrupt, truncated, of an unsupported format, or
    over the pixel limit."""


@dataclass(frozen=True)
class DecodedImage:
    """An image as 8-bit RGB, and the hash of the bytes it came from."""

    pixels: np.ndarray  # [height, width, 3] uint8
    content_hash: bytes  # blake2b-128 of the encoded bytes (or of the pixels, if given as such)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return self.pixels.shape[1], self.pixels.shape[0]


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """Encoded image bytes -> 8-bit RGB pixels.

    Raises:
        ImageError: not an image Pillow reads, truncated or corrupt, or more than
            max_pixels pixels (checked from the header, before decoding).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"an image must be given as bytes, not {type(data).__name__}")
    data = bytes(data)
    try:
        # The limit is checked here, not through Image.MAX_IMAGE_PIXELS, a process-wide
        # setting other threads may be relying on.
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    f"image is {width}x{height} = {width * height} pixels, over the limit of "
                    f"{max_pixels} (max_image_pixels)"
                )
            image.load()
            image = ImageOps.exif_transpose(image)
            rgb = image.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError("not an image in a format Pillow reads (unsupported or corrupt)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image refused as a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"image is truncated or corrupt: {exc}") from None
    return DecodedImage(np.asarray(rgb, dtype=np.uint8), content_hash(data))


def content_hash(data: bytes) -> bytes:
    """The hash an encoded image's embeddings and KV blocks are keyed by."""
    return hashlib.blake2b(bytes(data), digest_size=16).digest()


_ORIENTATION = 0x0112  # the EXIF tag ImageOps.exif_transpose reads
_QUARTER_TURNS = frozenset({5, 6, 7, 8})  # orientations it transposes width and height for


def _orientation(image) -> int | None:
    """The EXIF orientation an opened image's header gives (None: none there). A PNG's
    eXIf chunk may follow the pixel data, which Pillow would decode to reach it; one not
    seen at open is not looked for (a quarter turn it gives shows as a size mismatch at
    decode)."""
    if image.format == "PNG" and "exif" not in image.info:
        return None
    return image.getexif().get(_ORIENTATION)


def image_size(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """An encoded image's (width, height), from its header alone - nothing is decoded, so
    a planner checks every image of a job for the price of reading its first bytes. The
    size is that of `decode_image`'s pixels: swapped for an EXIF orientation that turns
    the image a quarter.

    Raises:
        ImageError: not an image Pillow reads, or over max_pixels.
    """
    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            width, height = image.size
            if _orientation(image) in _QUARTER_TURNS:
                width, height = height, width
    except UnidentifiedImageError:
        raise ImageError("not an image in a format Pillow reads (unsupported or corrupt)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image refused as a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"image is truncated or corrupt: {exc}") from None
    if width * height > max_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{max_pixels} (max_image_pixels)"
        )
    return width, height


def image_from_pil(image, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """A PIL image (already opened by the caller) -> 8-bit RGB, as `decode_image`."""
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
        )
    rgb = np.asarray(ImageOps.exif_transpose(image).convert("RGB"), dtype=np.uint8)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"pixels:%d:%d:" % (rgb.shape[1], rgb.shape[0]))
    digest.update(np.ascontiguousarray(rgb).tobytes())
    return DecodedImage(rgb, digest.digest())


def to_decoded(image, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """bytes, a PIL image or a DecodedImage -> DecodedImage (ImageError otherwise)."""
    if isinstance(image, DecodedImage):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_image(image, max_pixels=max_pixels)
    if isinstance(image, Image.Image):
        return image_from_pil(image, max_pixels=max_pixels)
    raise ImageError(f"an image must be encoded bytes or a PIL image, not {type(image).__name__}")


# Pillow's resampling filters by the number transformers writes (PILImageResampling).
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclass(frozen=True)
class ImageProcessor:
    """A fixed-size image processor, read from the model's image-processor config."""

    height: int
    width: int
    resample: int = 2  # PIL's BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # Gemma 3's pan-and-scan: how wide and tall images are cropped (None: never).
    pan_and_scan: PanAndScan | None = None

    @classmethod
    def from_config(
        cls, raw: dict, *, pan_and_scan: bool | None = EngineConfig.pan_and_scan
    ) -> ImageProcessor:
        """The processor a config describes; `pan_and_scan` True or False overrides the
        config's do_pan_and_scan (None: as the config says, null being off).

        Raises:
            ValueError: naming a setting it does not implement (a size given other than
                as height and width, no RGB conversion, cropping or padding).
        """
        if raw.get("do_convert_rgb") is False:
            raise ValueError("preprocessor_config.json sets do_convert_rgb false; not supported")
        if raw.get("do_center_crop") or raw.get("do_pad"):
            raise ValueError("preprocessor_config.json crops or pads images; not supported")
        size = raw.get("size") or {"height": 224, "width": 224}
        if set(size) != {"height", "width"}:
            raise ValueError(f"preprocessor_config.json size {size} is not a fixed height/width")
        resample = int(raw.get("resample", 2))
        if resample not in RESAMPLE_NAMES:
            raise ValueError(f"preprocessor_config.json resample {resample} is not a PIL filter")
        if pan_and_scan is None:
            pan_and_scan = bool(raw.get("do_pan_and_scan"))
        if pan_and_scan and raw.get("do_resize") is False:
            raise ValueError(
                "pan-and-scan with do_resize false (crops of their own sizes) is not supported"
            )
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            resample=resample,
            do_resize=bool(raw.get("do_resize", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=tuple(float(m) for m in raw.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(s) for s in raw.get("image_std", (0.5, 0.5, 0.5))),
            pan_and_scan=PanAndScan.from_config(raw) if pan_and_scan else None,
        )

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, *, pan_and_scan: bool | None = EngineConfig.pan_and_scan
    ) -> ImageProcessor:
        """The processor of the model in `model_dir` (`image_processor_config`)."""
        return cls.from_config(image_processor_config(model_dir), pan_and_scan=pan_and_scan)

    def boxes(self, width: int, height: int) -> list[Box]:
        """The pan-and-scan crops of a width x height image (none without pan-and-scan)."""
        return [] if self.pan_and_scan is None else self.pan_and_scan.boxes(width, height)

    def views(self, image: DecodedImage) -> torch.Tensor:
        """The image and its pan-and-scan crops, each resized as `resize` resizes,
        [1 + crops, height, width, 3] uint8 - the tower's images of it, in order."""
        crops = [
            DecodedImage(
                np.ascontiguousarray(image.pixels[top:bottom, left:right]), image.content_hash
            )
            for left, top, right, bottom in self.boxes(*image.size)
        ]
        return torch.stack([self.resize(view) for view in [image, *crops]])

    def __call__(self, image: DecodedImage) -> torch.Tensor:
        """-> [3, height, width] float32 pixel values."""
        return self.normalize(self.resize(image))

    def resize(self, image: DecodedImage) -> torch.Tensor:
        """-> the image resized as the processor resizes it, [height, width, 3] uint8."""
        pixels = image.pixels
        if self.do_resize and pixels.shape[:2] != (self.height, self.width):
            resample = getattr(Image.Resampling, RESAMPLE_NAMES[self.resample])
            resized = Image.fromarray(pixels).resize((self.width, self.height), resample=resample)
            pixels = np.asarray(resized)
        if not pixels.flags.writeable:  # the decoded image's own buffer: keep it intact
            pixels = pixels.copy()
        return torch.from_numpy(np.ascontiguousarray(pixels))

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """[height, width, 3] uint8 -> [3, height, width] float32 (`normalize_pixels`)."""
        return normalize_pixels(pixels, self)


def image_processor_config(model_dir: str | Path) -> dict:
    """The image-processor config of the model in `model_dir`, where transformers finds
    it: processor_config.json's "image_processor" (as transformers saves it now), else
    preprocessor_config.json.

    Raises:
        ValueError: neither holds one.
    """
    processor = Path(model_dir) / "processor_config.json"
    if processor.exists():
        nested = json.loads(processor.read_text(encoding="utf-8")).get("image_processor")
        if isinstance(nested, dict):
            return nested
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.exists():
        raise ValueError(
            f"{model_dir} has no preprocessor_config.json (nor an image_processor in "
            "processor_config.json): images need one"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def normalize_pixels(pixels: torch.Tensor, settings) -> torch.Tensor:
    """[height, width, 3] uint8 -> [3, height, width] float32: rescaled as transformers
    rescales (in float64, rounded to float32), normalised per channel in float32.
    `settings` carries do_rescale, rescale_factor, do_normalize, image_mean, image_std."""
    values = pixels.float()
    if settings.do_rescale:
        values = (pixels.double() * settings.rescale_factor).float()
    if settings.do_normalize:
        mean = torch.tensor(settings.image_mean, dtype=torch.float32)
        std = torch.tensor(settings.image_std, dtype=torch.float32)
        values = (values - mean) / std
    return values.permute(2, 0, 1).contiguous()
