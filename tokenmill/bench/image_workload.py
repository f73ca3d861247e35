"""Image benchmark workloads and the FLOP model of a vision tower's roofline.

A workload is N requests, each one image and a short prompt, with a fixed output length
(EOS ignored). The images are drawn with Pillow from a seed - sizes, aspect ratios and
formats mixed (JPEG mostly, as photographs are, PNG and WebP too), painted with gradients
and shapes so they encode to realistic sizes - and written once per invocation, so every
system decodes the same bytes. A prompt is token ids: the model's image marker(s), then
a few ordinary tokens. Each system places the image's tokens at the marker as its
processor does (transformers' image processor for the HF baseline).

FLOPs of the tower for one image (multiply-add = 2; h the tower's width, f its MLP
width, L layers, N patches of p x p px, C channels):

    SigLIP (Gemma 3), N = (image_size / p)^2 for every image:
        patch embedding  2 * N * C * p^2 * h
        each layer       2 * N * (4 h^2 + 2 h f)  +  4 * h * N^2
        projector        2 * T * h * H    (T soft tokens, H the text model's width)
    Qwen2.5-VL / Qwen2-VL, N = rows * columns of the image's grid (its resized size / p):
        patch embedding  2 * N * C * t * p^2 * h           (t: temporal_patch_size)
        each layer       2 * N * (4 h^2 + 3 h f)  +  4 * h * sum(S^2)
                         (Qwen2-VL's MLP is 2 h f; S the patches of each attention
                         segment: the whole image in a full-attention layer, each
                         window of window_size px in the others, Qwen2-VL has none)
        merger           2 * (N / m^2) * ((m^2 h)^2 + m^2 h * H)   (m: spatial_merge_size)

Norms, activations, rotary and pooling are not counted (a few percent at most).
"""

from __future__ import annotations

import io
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Aspect ratios (width / height) an image is drawn at: squares, photographs both ways,
# screenshots, a panorama and a receipt.
ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 1 / 3)
FORMATS = ("JPEG", "JPEG", "JPEG", "PNG", "WEBP")


@dataclass(frozen=True)
class ImageWorkloadSpec:
    """How to draw an image workload (long_side: inclusive px bounds of an image's
    longer side; prompt_len, output_len: tokens)."""

    name: str
    num_requests: int
    long_side: tuple[int, int] = (256, 1280)
    prompt_len: tuple[int, int] = (8, 24)
    output_len: int = 16
    seed: int = 0


IMAGE_PRESETS = {
    "images512": ImageWorkloadSpec("images512", num_requests=512),
    # For a tower at a real model's shape (Gemma 3 4B's SigLIP: about 5 TFLOP an image).
    "images32": ImageWorkloadSpec("images32", num_requests=32),
    # Seconds on a tiny model: for tests and for checking an installation.
    "images-smoke": ImageWorkloadSpec(
        "images-smoke", num_requests=12, long_side=(48, 320), output_len=4
    ),
}


@dataclass
class ImageWorkload:
    name: str
    prompt_ids: list[list[int]]  # with the model's unexpanded image marker(s)
    image_paths: list[str]  # one image per request, in the workload's folder
    image_sizes: list[tuple[int, int]]  # (width, height) as encoded
    output_lens: list[int]
    spec: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_ids)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, path: str | Path) -> ImageWorkload:
        raw = json.loads(Path(path).read_text())
        raw["image_sizes"] = [tuple(s) for s in raw["image_sizes"]]
        return cls(**raw)


def draw_image(rng: random.Random, long_side: tuple[int, int]) -> tuple[bytes, tuple[int, int]]:
    """One seeded image, encoded: (bytes, (width, height))."""
    from PIL import Image, ImageDraw

    side = rng.randint(*long_side)
    aspect = rng.choice(ASPECTS)
    width, height = (
        (side, max(1, round(side / aspect)))
        if aspect >= 1
        else (
            max(1, round(side * aspect)),
            side,
        )
    )
    top, bottom = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(2)]
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    image = Image.composite(Image.new("RGB", image.size, top), Image.new("RGB", image.size, bottom),
                            image.convert("L"))  # fmt: skip
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):
        box = (
            sorted(rng.randrange(width) for _ in range(2)),
            sorted(rng.randrange(height) for _ in range(2)),
        )
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        colour = tuple(rng.randrange(256) for _ in range(3))
        shape((box[0][0], box[1][0], box[0][1], box[1][1]), fill=colour)
    fmt = rng.choice(FORMATS)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt != "PNG" else {}))
    return buffer.getvalue(), (width, height)


def build_image_workload(
    spec: ImageWorkloadSpec, model_dir: str | Path, folder: str | Path
) -> ImageWorkload:
    """Draw `spec`'s images into `folder` and its prompts for the model in model_dir."""
    from tokenmill.bench.workload_data import ordinary_token_ids

    shape = VisionShape.from_dir(model_dir)
    added = set(shape.marker_ids)
    pool = [i for i in ordinary_token_ids(Path(model_dir) / "tokenizer.json") if i not in added]
    images = random.Random(f"{spec.seed}:images")
    tokens = random.Random(f"{spec.seed}:tokens")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prompts, paths, sizes = [], [], []
    for index in range(spec.num_requests):
        data, size = draw_image(images, spec.long_side)
        path = folder / f"{index:05d}.img"
        path.write_bytes(data)
        text = [tokens.choice(pool) for _ in range(tokens.randint(*spec.prompt_len))]
        prompts.append(list(shape.prompt_markers) + text)
        paths.append(str(path))
        sizes.append(size)
    return ImageWorkload(
        name=spec.name,
        prompt_ids=prompts,
        image_paths=paths,
        image_sizes=sizes,
        output_lens=[spec.output_len] * spec.num_requests,
        spec=asdict(spec),
    )


@dataclass(frozen=True)
class VisionShape:
    """A vision tower's shape, read from config.json and preprocessor_config.json."""

    family: str  # siglip | qwen2.5-vl | qwen2-vl
    hidden_size: int
    intermediate_size: int
    num_layers: int
    patch_size: int
    text_hidden_size: int  # the projector's (merger's) output
    marker_ids: tuple[int, ...]  # (begin, image token, end) marker ids
    channels: int = 3
    image_size: int = 0  # SigLIP: the fixed input side
    tokens_per_image: int = 0  # SigLIP: soft tokens after pooling
    merge_size: int = 1
    temporal_patch_size: int = 1
    window_size: int | None = None  # px; None: every layer attends over the whole image
    fullatt_layers: tuple[int, ...] = ()
    resize: dict = field(default_factory=dict)  # Qwen: min_pixels, max_pixels

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> VisionShape:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        vision, text = raw.get("vision_config") or {}, raw.get("text_config") or raw
        kind = raw.get("model_type")
        if kind == "gemma3":
            return cls(
                "siglip",
                vision["hidden_size"],
                vision["intermediate_size"],
                vision["num_hidden_layers"],
                vision["patch_size"],
                text["hidden_size"],
                (raw["boi_token_index"], raw["image_token_index"], raw["eoi_token_index"]),
                channels=vision.get("num_channels", 3),
                image_size=vision["image_size"],
                tokens_per_image=raw.get("mm_tokens_per_image", 256),
            )
        if kind in ("qwen2_5_vl", "qwen2_vl"):
            processor = json.loads((model_dir / "preprocessor_config.json").read_text())
            size = processor.get("size") or {}
            resize = {
                "min_pixels": processor.get("min_pixels", size.get("shortest_edge", 56 * 56)),
                "max_pixels": processor.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)),
            }
            markers = (
                raw["vision_start_token_id"],
                raw["image_token_id"],
                raw["vision_end_token_id"],
            )
            if kind == "qwen2_vl":
                width = vision.get("embed_dim", 1280)
                return cls(
                    "qwen2-vl",
                    width,
                    int(width * vision.get("mlp_ratio", 4)),
                    vision.get("depth", 32),
                    vision.get("patch_size", 14),
                    vision.get("hidden_size", 3584),
                    markers,
                    merge_size=vision.get("spatial_merge_size", 2),
                    temporal_patch_size=vision.get("temporal_patch_size", 2),
                    resize=resize,
                )
            return cls(
                "qwen2.5-vl",
                vision.get("hidden_size", 1280),
                vision.get("intermediate_size", 3420),
                vision.get("depth", 32),
                vision.get("patch_size", 14),
                vision.get("out_hidden_size", 3584),
                markers,
                merge_size=vision.get("spatial_merge_size", 2),
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                window_size=vision.get("window_size", 112),
                fullatt_layers=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                resize=resize,
            )
        raise ValueError(
            f"model_type {kind!r} has no image benchmark: gemma3, qwen2_5_vl and qwen2_vl do"
        )

    @property
    def prompt_markers(self) -> tuple[int, ...]:
        """What places one image in a token-id prompt: Gemma 3's begin-of-image id (the
        processor adds the soft tokens and end marker), Qwen's start, pad and end ids."""
        begin, image, end = self.marker_ids
        return (begin,) if self.family == "siglip" else (begin, image, end)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches the tower sees for an image of this size."""
        if self.family == "siglip":
            side = self.image_size // self.patch_size
            return side, side
        factor = self.patch_size * self.merge_size
        new_height, new_width = _smart_resize(height, width, factor, **self.resize)
        return new_height // self.patch_size, new_width // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        """Soft tokens of an image of this size in a prompt."""
        if self.family == "siglip":
            return self.tokens_per_image
        rows, columns = self.grid(width, height)
        return rows * columns // self.merge_size**2

    def tower_flops(self, width: int, height: int) -> int:
        """FLOPs of the tower (and projector or merger) for one image (module docstring)."""
        rows, columns = self.grid(width, height)
        n, h, f = rows * columns, self.hidden_size, self.intermediate_size
        embed = 2 * n * self.channels * self.temporal_patch_size * self.patch_size**2 * h
        mlp = 2 * h * f if self.family in ("siglip", "qwen2-vl") else 3 * h * f
        linear = 2 * n * (4 * h * h + mlp) * self.num_layers
        attention = 0
        for layer in range(self.num_layers):
            segments = self._segments(rows, columns, full=layer in self.fullatt_layers)
            attention += 4 * h * sum(s * s for s in segments)
        if self.family == "siglip":
            head = 2 * self.tokens_per_image * h * self.text_hidden_size
        else:
            group = self.merge_size**2 * h
            head = 2 * (n // self.merge_size**2) * (group * group + group * self.text_hidden_size)
        return embed + linear + attention + head

    def _segments(self, rows: int, columns: int, *, full: bool) -> list[int]:
        """Patches of each attention segment of one layer over one image."""
        if full or self.window_size is None:
            return [rows * columns]
        m = self.merge_size
        side = self.window_size // m // self.patch_size  # merged tokens
        merged_rows, merged_columns = rows // m, columns // m
        return [
            min(side, merged_rows - r) * min(side, merged_columns - c) * m * m
            for r in range(0, merged_rows, side)
            for c in range(0, merged_columns, side)
        ]

    def matmul_shapes(self, num_patches: int) -> list[tuple[int, int, int]]:
        """(m, k, n) of a tower call's big matmuls: qkv, attention output, MLP in and out."""
        h, f = self.hidden_size, self.intermediate_size
        return [
            (num_patches, h, 3 * h),
            (num_patches, h, h),
            (num_patches, h, f),
            (num_patches, f, h),
        ]


def _smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size Qwen2-VL's image processor resizes to: sides rounded to multiples of
    factor, the area scaled into [min_pixels, max_pixels] (transformers' rule, restated
    here so the FLOP model needs no engine internals; the test holds it to transformers)."""
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width
