"""The image benchmark's child process: one system answers the image workload once.

    python -m tokenmill.bench.image_child run SYSTEM.json WORKLOAD.json RESULT.json

Systems (each in a fresh process, so its threads, caches and peak RSS are its own):

    tokenmill   LLM.generate over every request at once, each image given as its encoded
                bytes: decoded and resized in the engine's decode pool beside the loop
    hf          transformers' generate, the HF user's best: requests sorted by length,
                batched with left padding; per batch the images decoded with Pillow and
                made into pixel values by the model's own image processor (transformers'
                default backend), then one generate call

Both generate exactly each request's output length (EOS ignored), greedy. The image
bytes are read from disk before the clock (a job has them from its input); model loading
and a warm-up request on an image outside the workload are not timed.

Measured inside the timed run: wall and CPU seconds of the process; the tower's seconds
(tokenmill: its profiler's "vision" stage; transformers: forward hooks on its vision
modules); preprocessing's CPU seconds - decode, resize and normalise: tokenmill's decode
threads' own CPU clocks plus its main thread's "images" stage (wall seconds),
transformers' decode and image processor calls.
"""

from __future__ import annotations

import io
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.bench.image_workload import ImageWorkload, VisionShape, draw_image
from tokenmill.bench.result import cpu_seconds, load_avg_1m, peak_rss_bytes

# The engine's decode pool's thread names start with this (engine/core/image_prefetch.py).
DECODE_THREAD_PREFIX = "tokenmill-image"
# transformers' modules that make image embeddings: the tower and its projector.
HF_VISION_MODULES = ("visual", "vision_tower", "multi_modal_projector")


@dataclass
class ImageSystem:
    label: str
    kind: str  # tokenmill | hf
    dtype: str = "float32"
    model_dir: str = ""
    engine_args: dict = field(default_factory=dict)
    batch_size: int = 16  # hf
    threads: int | None = None


@dataclass
class ImageRun:
    label: str
    wall_s: float
    cpu_s: float  # the process's, all threads
    tower_s: float  # wall seconds inside the vision tower and projector
    prep_cpu_s: float  # CPU seconds decoding, resizing and normalising images
    num_prompt_tokens: int
    num_image_tokens: int
    num_generated_tokens: int
    output_ids: list[list[int]]
    peak_rss_bytes: int = 0
    load_avg_1m: float = 0.0
    extra: dict = field(default_factory=dict)


def run(system: ImageSystem, workload: ImageWorkload) -> ImageRun:
    if system.threads:
        import torch

        torch.set_num_threads(system.threads)
    images = [Path(p).read_bytes() for p in workload.image_paths]
    runner = {"tokenmill": _tokenmill, "hf": _hf}[system.kind]
    result = runner(system, workload, images)
    result.peak_rss_bytes = peak_rss_bytes()
    result.load_avg_1m = load_avg_1m()
    return result


def _warmup_image(workload: ImageWorkload) -> bytes:
    """An image drawn apart from the workload's (no content hash in common)."""
    low = min(max(s) for s in workload.image_sizes)
    return draw_image(random.Random("warm-up"), (low, low))[0]


def _tokenmill(system: ImageSystem, workload: ImageWorkload, images: list[bytes]) -> ImageRun:
    from tokenmill.bench.profile import StageTimer
    from tokenmill.engine import LLM, SamplingParams

    llm = LLM(system.model_dir, dtype=system.dtype, device="cpu", **system.engine_args)
    warm = {"prompt_token_ids": workload.prompt_ids[0], "multi_modal_data": {"image": _warmup_image(workload)}}  # fmt: skip
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    timer = StageTimer()
    llm.set_profiler(timer)
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        for ids, image in zip(workload.prompt_ids, images)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    decode_before = decode_threads_cpu_s()
    cpu0, start = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    decode_cpu = decode_threads_cpu_s() - decode_before
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return ImageRun(
        label=system.label,
        wall_s=wall,
        cpu_s=cpu,
        tower_s=timer.seconds["vision"],
        prep_cpu_s=decode_cpu + timer.seconds["images"],
        num_prompt_tokens=sum(o.prompt_tokens for o in outputs),
        num_image_tokens=sum(o.image_tokens for o in outputs),
        num_generated_tokens=sum(o.completion_tokens for o in outputs),
        output_ids=[list(o.token_ids) for o in outputs],
        extra={
            "decode_threads_cpu_s": decode_cpu,
            "normalise_s": timer.seconds["images"],
            "tower_calls": timer.calls["vision"],
        },
    )


def decode_threads_cpu_s() -> float:
    """CPU seconds of this process's image decode threads so far (each thread's own CPU
    clock, pthread_getcpuclockid; 0.0 where the platform has none)."""
    total = 0.0
    for thread in threading.enumerate():
        if not thread.name.startswith(DECODE_THREAD_PREFIX) or thread.ident is None:
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):
            continue
    return total


class _ModuleClock:
    """Wall seconds spent inside the outermost of some modules (forward hooks)."""

    def __init__(self, modules: list) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._start = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, *_) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def _exit(self, *_) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._start


def _hf(system: ImageSystem, workload: ImageWorkload, images: list[bytes]) -> ImageRun:
    import torch
    import transformers
    from PIL import Image

    transformers.logging.set_verbosity_error()
    shape = VisionShape.from_dir(system.model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        system.model_dir, dtype=getattr(torch, system.dtype)
    ).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(system.model_dir)
    tower = _ModuleClock(
        [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in HF_VISION_MODULES]
    )
    begin, image_id, end = shape.marker_ids
    pad = 0

    def generate(rows: list[int], sources: list[bytes], num_new: int):
        """One batch: its images decoded and processed, its ids expanded, generated."""
        prep_cpu0 = time.thread_time()
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in sources]
        processed = processor(images=pil, return_tensors="pt")
        # What the model takes of it (Gemma 3's processor adds pan-and-scan's num_crops).
        inputs = {k: processed[k] for k in ("pixel_values", "image_grid_thw") if k in processed}
        prep = time.thread_time() - prep_cpu0
        if shape.family == "siglip":
            counts = [shape.tokens_per_image] * len(rows)
        else:
            counts = (inputs["image_grid_thw"].prod(-1) // shape.merge_size**2).tolist()
        prompts = [_expand(workload.prompt_ids[i], shape, n) for i, n in zip(rows, counts)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        extra = {"token_type_ids": (ids == image_id).long()}
        if shape.family != "siglip":
            extra = {"mm_token_type_ids": (ids == image_id).int()}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **inputs,
                **extra,
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=pad,
            )
        return out[:, width:].tolist(), prep, width, sum(counts)

    generate([0], [_warmup_image(workload)], 2)
    tower.seconds = 0.0
    n = workload.num_requests
    # Sorted by expanded length, so a batch pads little: the HF user's best.
    lengths = [
        len(_expand(workload.prompt_ids[i], shape, shape.image_tokens(*workload.image_sizes[i])))
        for i in range(n)
    ]
    order = sorted(range(n), key=lambda i: lengths[i])
    outputs: list[list[int]] = [[] for _ in range(n)]
    prep_cpu = 0.0
    num_image = computed = 0
    cpu0, start = cpu_seconds(), time.perf_counter()
    for at in range(0, n, system.batch_size):
        rows = order[at : at + system.batch_size]
        num_new = max(workload.output_lens[i] for i in rows)
        new_ids, prep, width, image_tokens = generate(rows, [images[i] for i in rows], num_new)
        prep_cpu += prep
        num_image += image_tokens
        computed += width * len(rows)
        for row, i in enumerate(rows):
            outputs[i] = new_ids[row][: workload.output_lens[i]]
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    return ImageRun(
        label=system.label,
        wall_s=wall,
        cpu_s=cpu,
        tower_s=tower.seconds,
        prep_cpu_s=prep_cpu,
        num_prompt_tokens=sum(lengths),
        num_image_tokens=num_image,
        num_generated_tokens=sum(workload.output_lens),
        output_ids=outputs,
        extra={
            "batch_size": system.batch_size,
            "computed_prompt_tokens": computed,  # left padding included
            "image_processor": type(processor).__name__,
        },
    )


def _expand(ids: list[int], shape: VisionShape, count: int) -> list[int]:
    """A prompt's ids with its image's place expanded as transformers' processor expands
    it: Gemma 3's begin marker followed by the soft tokens and end marker; Qwen's
    image_pad repeated once per token of the image."""
    begin, image, end = shape.marker_ids
    out: list[int] = []
    for token in ids:
        if shape.family == "siglip" and token == begin:
            out += [begin] + [image] * count + [end]
        elif shape.family != "siglip" and token == image:
            out += [image] * count
        else:
            out.append(token)
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 4 or argv[0] != "run":
        raise SystemExit(__doc__)
    system = ImageSystem(**json.loads(Path(argv[1]).read_text()))
    workload = ImageWorkload.from_json(argv[2])
    Path(argv[3]).write_text(json.dumps(asdict(run(system, workload))))


if __name__ == "__main__":
    main(sys.argv[1:])
