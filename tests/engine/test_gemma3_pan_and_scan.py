"""Gemma 3's pan-and-scan against transformers (fp32, random weights): the crops and
their pixels against transformers' default image processor here (the PIL backend,
`Gemma3ImageProcessorPil`), text prompts expanded as `Gemma3Processor` expands them,
greedy tokens and prompt log-probs as `Gemma3ForConditionalGeneration` computes them from
the processor's outputs; the crops' prefix-cache keys; the setting read from the model's
config, and refused by name where a model has no pan-and-scan."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from vision_models import IMAGE, TOKENS_PER_IMAGE, build_gemma3_vlm, png_bytes

from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.api.image_layouts import image_layout
from tokenmill.engine.api.image_prompts import ImagePrompts
from tokenmill.engine.loader.images import ImageProcessor, decode_image
from tokenmill.engine.loader.pan_and_scan import PanAndScan

# Crops of a 32 px tower's test images: 8 px at least, up to 3 of them (transformers'
# defaults - 256 px, 4 crops - would crop none of images this small).
SETTINGS = dict(
    pan_and_scan_min_crop_size=8,
    pan_and_scan_max_num_crops=3,
    pan_and_scan_min_ratio_to_activate=1.2,
)
# (width, height): wide (3 crops), tall (2; the last one shorter), square and small
# (none: under the ratio, crops under the minimum size), wide past the crop maximum.
SIZES = [(90, 30), (20, 37), (40, 40), (14, 6), (120, 17)]
WANT_CROPS = [3, 2, 0, 0, 3]


def reference_processor(**settings):
    """transformers' default Gemma 3 image processor here (torchvision is not installed:
    the PIL backend), at the tiny tower's 32 px."""
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, **settings)


@pytest.mark.parametrize(("size", "num_crops"), list(zip(SIZES, WANT_CROPS)))
def test_crops_and_pixels_equal_transformers_processor(size, num_crops):
    from PIL import Image
    from transformers.image_utils import load_image

    reference = reference_processor(do_pan_and_scan=True, **SETTINGS)
    ours = ImageProcessor.from_config(reference.to_dict())
    data = png_bytes(*size, seed=size[0])
    want = reference(load_image(Image.open(io.BytesIO(data))), return_tensors="pt")
    views = ours.views(decode_image(data))
    got = torch.stack([ours.normalize(view) for view in views])
    assert want["num_crops"].tolist() == [num_crops] == [len(ours.boxes(*size))]
    assert got.shape == want["pixel_values"].shape == (1 + num_crops, 3, 32, 32)
    torch.testing.assert_close(got, want["pixel_values"], atol=1e-5, rtol=0)


def test_crop_boxes_cut_the_long_side_as_transformers_does():
    scan = PanAndScan(**{k.removeprefix("pan_and_scan_"): v for k, v in SETTINGS.items()})
    assert scan.boxes(90, 30) == [(0, 0, 30, 30), (30, 0, 60, 30), (60, 0, 90, 30)]
    assert scan.boxes(20, 37) == [(0, 0, 20, 19), (0, 19, 20, 37)]
    assert scan.boxes(35, 30) == []  # ratio 1.17, under 1.2
    # Transformers' defaults: a 2000 x 500 image in 4 crops of 500 px; 1000 x 500 in 2.
    assert PanAndScan().boxes(2000, 500) == [(i * 500, 0, i * 500 + 500, 500) for i in range(4)]
    assert PanAndScan().num_crops(1000, 500) == 2
    assert PanAndScan().num_crops(600, 200) == 0  # a crop of 200 px is under 256


def test_settings_are_read_as_transformers_reads_them(tmp_path):
    """processor_config.json's image_processor before preprocessor_config.json, null
    settings as Gemma3Processor's defaults, and the engine setting over do_pan_and_scan."""
    nested = {**reference_processor().to_dict(), "do_pan_and_scan": True}
    nested["pan_and_scan_min_crop_size"] = None
    nested["pan_and_scan_max_num_crops"] = 2
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": nested}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_pan_and_scan": False}))
    processor = ImageProcessor.from_dir(tmp_path)
    assert processor.pan_and_scan == PanAndScan(256, 2, 1.2)
    assert ImageProcessor.from_dir(tmp_path, pan_and_scan=False).pan_and_scan is None
    (tmp_path / "processor_config.json").unlink()
    assert ImageProcessor.from_dir(tmp_path).pan_and_scan is None
    assert ImageProcessor.from_dir(tmp_path, pan_and_scan=True).pan_and_scan == PanAndScan()
    with pytest.raises(ValueError, match="pan_and_scan_max_num_crops must be >= 2"):
        ImageProcessor.from_config({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 1})


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny Gemma 3 VLM with the marker tokenizer, its image processor set to crop
    small images (pan-and-scan itself left off, as Gemma 3's configs leave it), and
    transformers' Gemma3Processor over the same files."""
    from vision_models import save_marker_tokenizer

    out = tmp_path_factory.mktemp("gemma3-pan-and-scan")
    hf = build_gemma3_vlm(out)
    processor = save_marker_tokenizer(out)
    processor.image_processor = reference_processor(**SETTINGS)
    processor.image_processor.save_pretrained(out)
    return hf, processor, out


def _hf_tokens_and_logprobs(hf, ids, pixels, num_tokens):
    """Greedy continuation by full forward passes (image tokens typed 1), and the prompt's
    log-softmax rows."""
    ids = list(ids)
    prompt_logprobs = None
    for _ in range(num_tokens):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = hf(
                input_ids=input_ids,
                pixel_values=pixels,
                token_type_ids=(input_ids == IMAGE).long(),
            ).logits[0]
        if prompt_logprobs is None:
            prompt_logprobs = torch.log_softmax(logits[:-1], dim=-1)
        ids.append(int(logits[-1].argmax()))
    return ids[-num_tokens:], prompt_logprobs


CASES = [
    ("describe <start_of_image> now.", [(90, 30)]),
    ("<start_of_image>a\n\n<start_of_image> and b", [(20, 37), (40, 40)]),
    ("x <start_of_image>y", [(14, 6)]),
    ("two <start_of_image><start_of_image>", [(120, 17), (90, 30)]),
]


def test_prompts_and_answers_equal_transformers_with_pan_and_scan(vlm):
    from PIL import Image

    hf, processor, model_dir = vlm
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        pan_and_scan=True,
        max_num_batched_tokens=64,
    )
    images = [[png_bytes(w, h, seed=w + h) for w, h in sizes] for _, sizes in CASES]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=256)
    outputs = llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": imgs}}
            for (text, _), imgs in zip(CASES, images)
        ],
        params,
    )
    for (text, sizes), imgs, out in zip(CASES, images, outputs):
        want = processor(
            text=text,
            images=[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs],
            do_pan_and_scan=True,
            return_tensors="pt",
            **SETTINGS,
        )
        assert out.error is None
        assert out.prompt_token_ids == want["input_ids"][0].tolist()
        views = len(want["pixel_values"])
        assert views == sum(1 + len(llm._image_prompts.processor.boxes(*s)) for s in sizes)
        assert out.image_tokens == views * TOKENS_PER_IMAGE
        tokens, logprobs = _hf_tokens_and_logprobs(
            hf, out.prompt_token_ids, want["pixel_values"], 4
        )
        assert out.outputs[0].token_ids == tokens
        got = torch.tensor([[entry[t] for t in range(256)] for entry in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, logprobs, atol=2e-3, rtol=0)


def test_the_planners_layout_counts_the_runs_tokens_from_sizes(vlm):
    """What a dry run counts: the layout's expansion from the images' header sizes,
    tokenized, is the run's prompt - no tower, no pixels."""
    _, _, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, pan_and_scan=True)
    layout = image_layout(model_dir, llm.tokenizer, pan_and_scan=True)
    assert image_layout(model_dir, llm.tokenizer).pan_and_scan is None  # the config's: off
    for text, sizes in CASES:
        expanded, _ = layout.expand(text, (), sizes)
        ids = llm.tokenizer.encode_batch([expanded], True)[0]
        imgs = [png_bytes(w, h, seed=w + h) for w, h in sizes]
        out = llm.generate(
            {"prompt": text, "multi_modal_data": {"image": imgs}},
            SamplingParams(max_tokens=1),
        )[0]
        assert ids == out.prompt_token_ids
        assert ids.count(IMAGE) == out.image_tokens


def test_crops_hit_the_prefix_cache_as_their_image_and_box_key_them(vlm, tmp_path):
    _, _, model_dir = vlm
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        pan_and_scan=True,
        enable_prefix_caching=True,
    )
    image = png_bytes(90, 30, seed=5)
    prompt = {"prompt": "see <start_of_image> it", "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    assert llm.engine.runner.vision.num_images_encoded == 4  # the image and 3 crops
    cached = llm.stats().cached_prompt_tokens
    again = llm.generate(prompt, params)[0]
    assert llm.engine.runner.vision.num_images_encoded == 4  # nothing encoded again
    num_prompt = len(first.prompt_token_ids)
    assert llm.stats().cached_prompt_tokens - cached == (num_prompt - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Keys: the whole image's is its content hash; a crop's, that and its box - so
    # other settings cropping other boxes key other crops.
    prompts = llm._image_prompts
    keys = [span.content_hash for span in prompts.prepare(prompt).images]
    assert keys[0] == decode_image(image).content_hash and len(set(keys)) == 4
    other = ImagePrompts(
        model_dir, llm.model_config, llm.tokenizer, pan_and_scan=True
    )  # the same settings: the same keys
    assert [s.content_hash for s in other.prepare(prompt).images] == keys
    # At most two crops: two of 45 px, not three of 30 - other boxes, other keys (the
    # image's own kept).
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    config["pan_and_scan_max_num_crops"] = 2
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    fewer = ImagePrompts(tmp_path, llm.model_config, llm.tokenizer, pan_and_scan=True)
    two = [span.content_hash for span in fewer.prepare(prompt).images]
    assert len(two) == 3 and two[0] == keys[0] and not set(two[1:]) & set(keys)


def test_token_ids_must_hold_every_crops_block(vlm):
    _, _, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, pan_and_scan=True)
    from vision_models import BOI

    wide, square = png_bytes(90, 30, seed=1), png_bytes(40, 40, seed=2)
    outs = llm.generate(
        [
            {"prompt_token_ids": [5, BOI, 6], "multi_modal_data": {"image": wide}},
            {"prompt_token_ids": [5, BOI, 6], "multi_modal_data": {"image": square}},
        ],
        SamplingParams(max_tokens=1),
    )
    assert outs[0].finish_reason == "error"
    assert "pan-and-scan shows the 1 image(s) given as 4" in outs[0].error
    assert outs[1].error is None and outs[1].image_tokens == TOKENS_PER_IMAGE


def test_pan_and_scan_is_refused_by_name_where_a_model_has_none(tmp_path):
    import test_qwen_vl_model as qwen
    import transformers
    from hf_models import build_hf_model, save_char_tokenizer

    qwen_dir = tmp_path / "qwen"
    config = transformers.Qwen2_5_VLConfig(
        text_config=qwen._text_config(),
        vision_config=qwen.VISION,
        image_token_id=qwen.IMAGE,
        vision_start_token_id=qwen.VSTART,
        vision_end_token_id=qwen.VEND,
        video_token_id=253,
    )
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(qwen_dir)
    qwen.hf_processor().save_pretrained(qwen_dir)
    save_char_tokenizer(qwen_dir, qwen.VOCAB)
    with pytest.raises(ValueError, match="Qwen2-VL's dynamic resolution.*has no pan-and-scan"):
        LLM(str(qwen_dir), dtype="float32", device="cpu", pan_and_scan=True)
    with pytest.raises(ValueError, match="has no pan-and-scan"):
        image_layout(qwen_dir, None, pan_and_scan=True)
    text_dir = tmp_path / "text"
    build_hf_model("llama", text_dir)
    save_char_tokenizer(text_dir, 256)
    with pytest.raises(ValueError, match="pan_and_scan is set, but the model has no vision"):
        LLM(str(text_dir), dtype="float32", device="cpu", pan_and_scan=True)
    with pytest.raises(ValueError, match="pan_and_scan must be true, false or None"):
        LLM(str(text_dir), pan_and_scan="yes")
