"""Gemma 3 with images against transformers on the same random weights (fp32): pixel
preprocessing against transformers' default image processor here, the SigLIP tower and
projector, soft tokens placed at the prompt's markers, bidirectional attention within
an image (across chunk boundaries and prefix-cache hits), through `LLM.generate`."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from hf_models import save_char_tokenizer
from vision_models import (
    BOI,
    EOI,
    IMAGE,
    TOKENS_PER_IMAGE,
    build_gemma3_vlm,
    image_processor,
    png_bytes,
)

from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.loader.images import ImageError, ImageProcessor, decode_image

VOCAB = 256
# The char tokenizer's character of each id (hf_models.save_char_tokenizer).
CHARS = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
CHARS += [chr(0x4E00 + i) for i in range(VOCAB - len(CHARS))]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + CHARS[BOI] + "{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-vlm")
    hf = build_gemma3_vlm(out)
    save_char_tokenizer(out, VOCAB)
    # A chat template that writes the begin-of-image marker for an image part, as Gemma 3's.
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return hf, out


def test_the_reference_processor_is_transformers_pil_backend():
    """torchvision is not installed here, so transformers' default Gemma 3 image processor
    falls back to its PIL backend - the one these tests compare against."""
    from transformers import Gemma3ImageProcessor, Gemma3ImageProcessorPil

    with pytest.raises(ImportError):
        import torchvision  # noqa: F401
    assert type(Gemma3ImageProcessor()) is Gemma3ImageProcessorPil
    assert type(image_processor()) is Gemma3ImageProcessorPil


@pytest.mark.parametrize(
    ("width", "height", "mode", "fmt"),
    [
        (50, 37, "RGB", "PNG"),
        (13, 90, "RGBA", "PNG"),
        (40, 40, "L", "PNG"),
        (33, 21, "CMYK", "JPEG"),
        (32, 32, "RGB", "JPEG"),
        (64, 20, "P", "PNG"),
        (25, 31, "I;16", "PNG"),
        (70, 33, "RGB", "WEBP"),
    ],
)
def test_pixels_equal_transformers_processor(width, height, mode, fmt):
    from PIL import Image
    from transformers.image_utils import load_image

    reference = image_processor(32)
    ours = ImageProcessor.from_config(reference.to_dict())
    data = png_bytes(width, height, seed=width, mode=mode, fmt=fmt)
    want = reference(load_image(Image.open(io.BytesIO(data))), return_tensors="pt")
    got = ours(decode_image(data))
    assert got.shape == want["pixel_values"][0].shape == (3, 32, 32)
    torch.testing.assert_close(got, want["pixel_values"][0], atol=1e-5, rtol=0)


def test_exif_orientation_is_applied_as_load_image_does():
    from PIL import Image
    from transformers.image_utils import load_image

    image = Image.frombytes("RGB", (6, 3), bytes(range(54)))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif, quality=100)
    data = buffer.getvalue()
    want = load_image(Image.open(io.BytesIO(data)))
    got = decode_image(data)
    assert got.size == want.size == (3, 6)
    assert (got.pixels == torch.tensor(list(want.getdata())).view(6, 3, 3).numpy()).all()


def test_bad_images_are_refused_by_what_is_wrong():
    good = png_bytes(20, 20, seed=1)
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(good[: len(good) // 2])
    with pytest.raises(ImageError, match="not an image in a format"):
        decode_image(b"GIF89a but not really" * 3)
    with pytest.raises(ImageError, match=r"20x20 = 400 pixels, over the limit of 399"):
        decode_image(good, max_pixels=399)


def _hf_tokens_and_logprobs(hf, ids, pixels, num_tokens):
    """Greedy continuation by full forward passes (image tokens typed 1), and the prompt's
    log-softmax rows."""
    ids = list(ids)
    prompt_logprobs = None
    for _ in range(num_tokens):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = (
                hf(
                    input_ids=input_ids,
                    pixel_values=pixels,
                    token_type_ids=(input_ids == IMAGE).long(),
                )
                .logits[0]
                .float()
            )
        if prompt_logprobs is None:
            prompt_logprobs = torch.log_softmax(logits[:-1], dim=-1)
        ids.append(int(logits[-1].argmax()))
    return ids[-num_tokens:], prompt_logprobs


def _prompt(text_ids, image_places):
    """Token ids with a begin-of-image marker before each index in image_places."""
    out = []
    for i, token in enumerate(text_ids):
        if i in image_places:
            out.append(BOI)
        out.append(token)
    return out


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=64),
        # Chunks of 24 and block-sized prefix-cache hits: an image is never split, and a
        # hit may end inside one.
        dict(max_num_batched_tokens=24, enable_prefix_caching=True),
    ],
)
def test_image_prompts_match_transformers_through_llm(vlm, settings):
    hf, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, **settings)
    llm.engine.runner.vision.max_images_per_batch = 2  # a step's images in tower groups
    g = torch.Generator().manual_seed(7)
    cases = []
    # One image, two images (of two sizes each), the image first and last in the prompt.
    for places, sizes in [
        ({3}, [(48, 40)]),
        ({0, 9}, [(20, 64), (32, 32)]),
        ({5}, [(100, 30)]),
        ({2, 4}, [(32, 32), (32, 32)]),
    ]:
        text = torch.randint(0, 200, (12,), generator=g).tolist()
        images = [png_bytes(w, h, seed=w * h) for w, h in sizes]
        cases.append((_prompt(text, places), images))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=VOCAB)
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases
    ]
    outputs = llm.generate(prompts, params)
    # Six images, four distinct (equal bytes, equal hash): each through the tower once.
    assert llm.engine.runner.vision.num_images_encoded == 4
    processor = image_processor()
    from PIL import Image

    for (ids, images), out in zip(cases, outputs):
        assert out.error is None
        expanded = []
        for t in ids:
            expanded += [t] + ([IMAGE] * TOKENS_PER_IMAGE + [EOI] if t == BOI else [])
        assert out.prompt_token_ids == expanded
        assert out.image_tokens == TOKENS_PER_IMAGE * len(images)
        assert out.prompt_tokens == len(expanded)  # image tokens inside, as OpenAI counts
        pixels = processor(
            [Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
        )["pixel_values"]
        want_tokens, want_logprobs = _hf_tokens_and_logprobs(hf, expanded, pixels, 6)
        assert out.outputs[0].token_ids == want_tokens
        got = torch.tensor([[entry[t] for t in range(VOCAB)] for entry in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want_logprobs, atol=2e-3, rtol=0)


def test_same_image_same_prefix_hits_the_prefix_cache_and_another_image_does_not(vlm):
    hf, model_dir = vlm
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=True
    )
    ids = _prompt(list(range(10, 30)), {2})
    a, b = png_bytes(40, 40, seed=1), png_bytes(40, 40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, params)[0]
    cached_before = llm.stats().cached_prompt_tokens
    same = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, params)[0]
    after_same = llm.stats().cached_prompt_tokens
    other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}}, params)[0]
    after_other = llm.stats().cached_prompt_tokens
    num_prompt = len(first.prompt_token_ids)
    # The same (image, prompt): every full block but the last token's is served.
    assert after_same - cached_before == (num_prompt - 1) // 4 * 4
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    # Another image under the same placeholder ids: only the blocks before it are served.
    assert after_other - after_same == 3 // 4 * 4  # BOI sits at position 2: block 0 ends at 4
    assert llm.engine.runner.vision.num_images_encoded == 2
    from PIL import Image

    pixels = image_processor()([Image.open(io.BytesIO(b)).convert("RGB")], return_tensors="pt")[
        "pixel_values"
    ]
    expanded = other.prompt_token_ids
    assert other.outputs[0].token_ids == _hf_tokens_and_logprobs(hf, expanded, pixels, 3)[0]


def test_bad_images_and_mismatched_markers_are_error_outputs_and_others_answered(vlm):
    _, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    good = png_bytes(30, 30, seed=3)
    ids = _prompt(list(range(10, 20)), {1})
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": good[: len(good) // 2]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": good}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [good, good]}},
        {"prompt_token_ids": list(range(10, 20)) + [IMAGE], "multi_modal_data": {"image": []}},
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error"]
    assert "truncated or corrupt" in outs[0].error
    assert "places 1 image(s)" in outs[2].error and "2 were given" in outs[2].error
    assert "outside an image's place" in outs[3].error
    with pytest.raises(ValueError, match="multi_modal_data takes only 'image'"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": b""}})


def test_a_text_model_refuses_images_by_name(tmp_path):
    from hf_models import build_hf_model

    build_hf_model("llama", tmp_path)
    save_char_tokenizer(tmp_path, VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="no vision tower: it cannot take images"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": b"x"}})


def test_every_field_of_the_vision_config_class_is_declared():
    import dataclasses

    from transformers import SiglipVisionConfig

    from tokenmill.engine.models.config_fields import BASE_FIELDS
    from tokenmill.engine.models.gemma3_vision import VISION_CONFIG_FIELDS

    declared = VISION_CONFIG_FIELDS.declared
    assert {f.name for f in dataclasses.fields(SiglipVisionConfig)} - declared == set()
    assert set(SiglipVisionConfig().to_dict()) - declared - set(BASE_FIELDS) == set()


def test_chat_with_openai_image_parts_equals_generate_with_the_same_ids(vlm):
    _, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    image = png_bytes(45, 30, seed=11)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "abc"},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "de"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
            }
        ],
        [{"role": "user", "content": "plain text"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat(conversations, params)
    ids = [0, 1, 2, BOI, 3, 4]  # a b c <boi> d e
    direct = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params)
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    assert chat[1].finish_reason == "error" and "scheme 'https' is not read" in chat[1].error
    assert chat[2].finish_reason == "length"


def test_chat_with_images_adds_no_second_bos(vlm, tmp_path):
    """A chat template writes the BOS itself (Gemma 3's does), so a rendered conversation is
    encoded without the tokenizer's own BOS - with images as without them."""
    import shutil

    from tokenizers import Tokenizer, processors

    _, model_dir = vlm
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    bos = 200
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CHARS[bos]} $A", special_tokens=[(CHARS[bos], bos)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(bos_token=CHARS[bos], chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4)
    image = png_bytes(45, 30, seed=11)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": url}}]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with_image, text_only = llm.chat(
        [[{"role": "user", "content": parts}], [{"role": "user", "content": "ab"}]], params
    )
    direct = llm.generate(
        {"prompt_token_ids": [bos, 0, 1, BOI], "multi_modal_data": {"image": image}}, params
    )
    assert text_only.prompt_token_ids == [bos, 0, 1]
    assert with_image.prompt_token_ids == direct[0].prompt_token_ids
    assert with_image.prompt_token_ids.count(bos) == 1


@pytest.mark.parametrize(
    "text",
    [
        "ab\n<start_of_image>cd <start_of_image>\n\ne",
        "<start_of_image>describe it.",
        "x\n\n<start_of_image>",
    ],
)
def test_text_prompts_have_transformers_processor_tokens_and_answers(tmp_path, text):
    """Text prompts expand as transformers' Gemma3Processor expands them (its token ids,
    hence its token counts), and generate what transformers generates from its output."""
    from PIL import Image
    from vision_models import save_marker_tokenizer

    hf = build_gemma3_vlm(tmp_path)
    processor = save_marker_tokenizer(tmp_path)
    count = text.count("<start_of_image>")
    images = [png_bytes(30 + 7 * i, 41, seed=i) for i in range(count)]
    want = processor(
        text=text,
        images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
        return_tensors="pt",
    )
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0]
    assert out.prompt_token_ids == want["input_ids"][0].tolist()
    assert out.prompt_token_ids.count(IMAGE) == count * TOKENS_PER_IMAGE
    expected, _ = _hf_tokens_and_logprobs(hf, out.prompt_token_ids, want["pixel_values"], 4)
    assert out.outputs[0].token_ids == expected


def test_image_parts_render_only_where_images_are_placed(vlm):
    """Outside LLM.chat's image path a template never gets an image part: it would write
    a begin-of-image marker with no image behind it."""
    from tokenmill.engine import Tokenizer

    _, model_dir = vlm
    tokenizer = Tokenizer.from_dir(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]
    with pytest.raises(ValueError, match="needs a string 'content'"):
        tokenizer.apply_chat_template(messages)
    assert tokenizer.apply_chat_template(messages, image_parts=True) == CHARS[BOI] + "a"


def test_a_prefix_cache_hit_ending_inside_an_image_computes_the_rest_of_it(vlm):
    """A prompt that ends with its image: the second time, the cache serves whole blocks
    up to inside the image, and its last soft token is computed seeing the whole image."""
    hf, model_dir = vlm
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=True
    )
    ids = [7, 8, BOI]  # expands to 7 8 <boi> 16 x <image> <eoi>: 20 tokens
    image = png_bytes(36, 28, seed=5)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=VOCAB)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    # (20 - 1) // 4 = 4 blocks: positions 0..15, inside the image (positions 3..18).
    assert again.cached_tokens == 16
    from PIL import Image

    pixels = image_processor()([Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")[
        "pixel_values"
    ]
    want = _hf_tokens_and_logprobs(hf, first.prompt_token_ids, pixels, 5)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    for a, b in zip(first.outputs[0].logprobs, again.outputs[0].logprobs):
        got = torch.tensor([b[t] for t in range(VOCAB)])
        torch.testing.assert_close(
            got, torch.tensor([a[t] for t in range(VOCAB)]), atol=2e-4, rtol=0
        )


def test_preempted_image_prompts_recompute_to_the_same_answers(vlm):
    """A cache too small for every sequence at once: image prompts are preempted and
    recomputed (their images re-placed, the tower's output reused by content hash)."""
    _, model_dir = vlm
    prompts = [
        {
            "prompt_token_ids": _prompt([20 + i, 21, 22, 23, 24, 25, 26, 27], {1}),
            "multi_modal_data": {"image": png_bytes(30 + i, 30, seed=i)},
        }
        for i in range(4)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    # 4 layers x (k + v) x 1 kv head x 32 values x 4 positions x 4 bytes = 4 KiB a block.
    tight = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        kv_cache_memory=20 * 4096,
        max_num_seqs=4,  # set: admitted by their prompt alone, so decode preempts
    )
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    assert tight.engine.runner.vision.num_images_encoded == 4


def test_every_vision_tensor_is_consumed_or_the_checkpoint_is_refused(vlm, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.engine.loader.weights import load_model
    from tokenmill.engine.models import load_config

    _, model_dir = vlm
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    tensors = load_file(model_dir / "model.safetensors")
    config = load_config(model_dir)
    cpu = dict(dtype=torch.float32, device=torch.device("cpu"))
    extra = {**tensors, "vision_tower.encoder.layers.2.mlp.fc1.weight": torch.zeros(64, 32)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no place for: vision_tower\.encoder\.layers\.2"):
        load_model(tmp_path, config, **cpu)
    missing = {k: v for k, v in tensors.items() if "post_layernorm.weight" not in k}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: vision_tower\.post_layernorm\.weight"):
        load_model(tmp_path, config, **cpu)
