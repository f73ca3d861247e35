"""The image bench: its seeded workload, its tower FLOP model against torch's own FLOP
counter on transformers' towers, its token counts against transformers' image
processors, and `tokenmill bench --preset images-smoke` end to end on a tiny random
Qwen2.5-VL (tokenmill against transformers' generate, one round)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenmill.bench.image_workload import (
    ASPECTS,
    IMAGE_PRESETS,
    ImageWorkloadSpec,
    VisionShape,
    build_image_workload,
    draw_image,
)
from tokenmill.bench.tiny_vlm import build_tiny_vlm
from tokenmill.cli import main

# (width, height): square, portrait, a wide strip, tiny, and over the pixel bound.
SIZES = [(150, 267), (96, 48), (300, 40), (33, 33), (640, 480)]


@pytest.fixture(scope="module", params=["qwen2.5-vl", "gemma3"])
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_vlm("qwen2.5-vl", tmp_path_factory.mktemp("qwen"))


def test_the_tower_flop_model_equals_torchs_flop_counter_on_transformers_tower(vlm_dir):
    """Every matmul, convolution and attention product of transformers' tower and
    projector (eager attention, so torch's FlopCounterMode sees each product) for one
    image of each size: exactly the formula's count."""
    import torch
    import transformers
    from PIL import Image
    from torch.utils.flop_counter import FlopCounterMode

    shape = VisionShape.from_dir(vlm_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        vlm_dir, attn_implementation="eager"
    ).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(vlm_dir)
    for width, height in SIZES:
        inputs = processor(images=[Image.new("RGB", (width, height), (9, 99, 199))], return_tensors="pt")  # fmt: skip
        grid = {"image_grid_thw": inputs["image_grid_thw"]} if "image_grid_thw" in inputs else {}
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.model.get_image_features(inputs["pixel_values"], **grid)
        assert shape.tower_flops(width, height) == counter.get_total_flops(), (width, height)


def test_image_tokens_equal_transformers_image_processor(vlm_dir):
    import transformers
    from PIL import Image

    shape = VisionShape.from_dir(vlm_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(vlm_dir)
    for width, height in SIZES:
        inputs = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")
        if "image_grid_thw" in inputs:
            _, rows, columns = inputs["image_grid_thw"][0].tolist()
            assert shape.grid(width, height) == (rows, columns)
            want = rows * columns // shape.merge_size**2
        else:
            want = 16  # the tiny Gemma 3's mm_tokens_per_image
        assert shape.image_tokens(width, height) == want


def test_the_workload_is_seeded_and_mixed(qwen_dir, tmp_path):
    spec = ImageWorkloadSpec("t", num_requests=40, long_side=(40, 200), prompt_len=(3, 5))
    one = build_image_workload(spec, qwen_dir, tmp_path / "one")
    two = build_image_workload(spec, qwen_dir, tmp_path / "two")
    assert one.prompt_ids == two.prompt_ids and one.image_sizes == two.image_sizes
    for a, b in zip(one.image_paths, two.image_paths):
        assert Path(a).read_bytes() == Path(b).read_bytes()
    # Qwen's marker triple, then 3 to 5 ordinary tokens (none of them a marker).
    shape = VisionShape.from_dir(qwen_dir)
    for ids in one.prompt_ids:
        assert tuple(ids[:3]) == shape.marker_ids and 3 <= len(ids) - 3 <= 5
        assert not set(ids[3:]) & set(shape.marker_ids)
    # Sizes, aspect ratios and formats vary, and every image is what its size says.
    from PIL import Image

    formats = set()
    for path, size in zip(one.image_paths, one.image_sizes):
        with Image.open(path) as image:
            assert image.size == size
            formats.add(image.format)
        assert 40 <= max(size) <= 200
    assert formats == {"JPEG", "PNG", "WEBP"}
    ratios = {round(w / h, 1) for w, h in one.image_sizes}
    assert len(ratios) >= 5
    assert len(set(one.image_sizes)) >= 30
    other = build_image_workload(
        ImageWorkloadSpec("t", 40, (40, 200), (3, 5), seed=1), qwen_dir, tmp_path / "three"
    )
    assert other.image_sizes != one.image_sizes


def test_a_drawn_image_keeps_its_aspect_ratio():
    rng = random.Random(5)
    for _ in range(50):
        data, (width, height) = draw_image(rng, (100, 400))
        assert 100 <= max(width, height) <= 400
        assert min(abs(width / height - a) for a in ASPECTS) < 0.02 + 1 / min(width, height)


def test_the_presets_are_what_the_brief_names():
    assert IMAGE_PRESETS["images512"].num_requests == 512
    assert IMAGE_PRESETS["images-smoke"].num_requests == 12


@pytest.mark.slow  # three processes importing transformers: ~30 s on 2 busy cores
def test_images_smoke_end_to_end_writes_the_report(qwen_dir, tmp_path):
    """tokenmill fp32 and transformers (batches of 12) once each on 12 images: the same
    image tokens, the same greedy tokens, the tower timed in both, shares within [0, 1]."""
    out = tmp_path / "images.json"
    args = ["bench", "--preset", "images-smoke", "--model", str(qwen_dir), "--dtype", "float32",
            "--hf-batch-size", "12", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    shape = VisionShape.from_dir(qwen_dir)
    workload_tokens = report["num_image_tokens"]
    assert report["num_requests"] == 12 and workload_tokens > 12 * 16
    systems = {s["label"]: s for s in report["systems"]}
    assert set(systems) == {"tokenmill-fp32", "hf-fp32"}
    assert report["reference"] == "hf-fp32"
    for summary in systems.values():
        assert summary["error"] is None and summary["num_runs"] == 1
        assert summary["same_tokens"] == 12
        assert summary["tower_s"] > 0 and 0 < summary["tower_share"] <= 1
        assert 0 < summary["prep_cpu_share"] <= 1
        assert summary["image_tokens_per_s"] == pytest.approx(workload_tokens / summary["wall_s"])
    assert systems["hf-fp32"]["extra"]["batch_size"] == 12
    assert systems["tokenmill-fp32"]["ratios"].keys() == {"hf-fp32"}
    assert report["tower_tflop"] * 1e12 == pytest.approx(
        sum(shape.tower_flops(*s) for s in _sizes(report, qwen_dir))
    )
    assert "CPU:" in result.output


def _sizes(report, model_dir):
    spec = IMAGE_PRESETS[report["preset"]]
    rng = random.Random(f"{spec.seed}:images")
    return [draw_image(rng, spec.long_side)[1] for _ in range(spec.num_requests)]


def test_the_engine_reports_the_tower_and_the_decode_threads_to_the_bench(qwen_dir):
    """What the image child reads: the profiler's "vision" and "images" stages (one
    each per tower call) and the CPU clocks of the engine's decode threads, found by
    their name."""
    from tokenmill.bench.image_child import decode_threads_cpu_s
    from tokenmill.bench.profile import StageTimer
    from tokenmill.engine import LLM, SamplingParams

    llm = LLM(str(qwen_dir), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    timer = StageTimer()
    llm.set_profiler(timer)
    shape = VisionShape.from_dir(qwen_dir)
    rng = random.Random(3)
    prompts = [
        {
            "prompt_token_ids": [*shape.prompt_markers, 5, 6],
            "multi_modal_data": {"image": draw_image(rng, (300, 400))[0]},
        }
        for _ in range(6)
    ]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert all(o.error is None for o in outputs)
    assert timer.calls["vision"] == timer.calls["images"] >= 1
    assert timer.seconds["vision"] > 0 and timer.seconds["images"] > 0
    # Six images of up to 400 px decoded and resized in the pool: some CPU time, on the
    # threads the child looks for.
    assert decode_threads_cpu_s() > 0


def test_hf_bf16_is_an_image_baseline_that_runs_transformers_in_bf16(
    qwen_dir, tmp_path, monkeypatch
):
    """`--baseline hf,hf-bf16`: transformers' generate in each precision as a system of its
    own; the bf16 one loads the model in bf16 and answers every row in full."""
    import dataclasses

    import torch
    import transformers

    from tokenmill.bench import image_child
    from tokenmill.bench.image_harness import ImageBenchConfig, hf_systems

    config = ImageBenchConfig("images-smoke", str(qwen_dir), baselines=("hf", "hf-bf16"))
    systems = hf_systems(config, str(qwen_dir))
    assert [(s.label, s.kind, s.dtype) for s in systems] == [
        ("hf-fp32", "hf", "float32"),
        ("hf-bf16", "hf", "bfloat16"),
    ]
    with pytest.raises(ValueError, match=r"unknown image baseline\(s\) \['hf-fp16'\]"):
        ImageBenchConfig("images-smoke", str(qwen_dir), baselines=("hf-fp16",))
    spec = ImageWorkloadSpec("t", 3, (40, 120), (3, 5), output_len=3, seed=2)
    workload = build_image_workload(spec, qwen_dir, tmp_path / "images")
    loaded = []
    auto = transformers.AutoModelForImageTextToText
    load = auto.from_pretrained

    def recording(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.append({p.dtype for p in model.parameters()})
        return model

    monkeypatch.setattr(auto, "from_pretrained", recording)
    run = image_child.run(dataclasses.replace(systems[1], batch_size=3), workload)
    assert loaded == [{torch.bfloat16}]
    assert [len(ids) for ids in run.output_ids] == [3, 3, 3]
    assert run.tower_s > 0
