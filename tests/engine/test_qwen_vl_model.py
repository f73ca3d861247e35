"""Qwen2.5-VL with images against transformers on the same random weights (fp32): image
tokens placed at the prompt's image_pad markers and counted as transformers' processor
counts them, 3D rotary positions (M-RoPE) over prompts with one and several images of
different sizes, prompt log-probs and greedy tokens - with chunked prefill splitting
images, the prefix cache and preemption - through `LLM.generate` and `LLM.chat`."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from hf_models import SMALL, save_char_tokenizer
from vision_models import png_bytes

from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.core.images import ImageSpan
from tokenmill.engine.core.mrope import mrope_delta, mrope_positions

VOCAB = 256
VSTART, VEND, IMAGE = 250, 251, 252
# Patches of 4 px merged 2 x 2 (an image token is 8 x 8 px); windows of 16 px.
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    out_hidden_size=SMALL["hidden_size"],
    fullatt_block_indexes=[1],
)
# head_dim 16: 8 rotary frequencies, 2 turned by time, 3 by row, 3 by column.
MROPE_SECTION = [2, 3, 3]
PIXELS = dict(min_pixels=8 * 8, max_pixels=48 * 48)
CHARS = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
CHARS += [chr(0x4E00 + i) for i in range(VOCAB - len(CHARS))]


def hf_processor():
    """transformers' default Qwen2-VL image processor here: torchvision is not
    installed, so it is the PIL backend (test_qwen_vl_images.py checks that)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, **PIXELS)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("qwen2-5-vl")
    text = {
        **SMALL,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": MROPE_SECTION,
        },
    }
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=VISION,
        image_token_id=IMAGE,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        video_token_id=253,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                if name.endswith("norm1.weight") or name.endswith("norm2.weight") or (
                    "ln_q" in name
                ):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
                else:
                    param.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    hf_processor().save_pretrained(out)
    save_char_tokenizer(out, VOCAB)
    return model, out


def _hf_run(hf, ids, images, num_tokens):
    """Greedy continuation by full forward passes, and the prompt's log-softmax rows."""
    from PIL import Image

    pixels = grid = None
    if images:
        processed = hf_processor()(
            [Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
        )
        pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    ids = list(ids)
    prompt_logprobs = None
    for _ in range(num_tokens):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = hf(
                input_ids=input_ids,
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(input_ids == IMAGE).int(),
                use_cache=False,
            ).logits[0]
        if prompt_logprobs is None:
            prompt_logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        ids.append(int(logits[-1].argmax()))
    return ids[-num_tokens:], prompt_logprobs


def _prompt(text_ids, image_places):
    """Token ids with <|vision_start|><|image_pad|><|vision_end|> before each index in
    image_places."""
    out = []
    for i, token in enumerate(text_ids):
        if i in image_places:
            out += [VSTART, IMAGE, VEND]
        out.append(token)
    return out


def _expanded(ids, images):
    """The ids as transformers' processor expands them: each image_pad repeated once per
    token of its image."""
    from PIL import Image

    processed = hf_processor()(
        [Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
    )
    counts = iter((processed["image_grid_thw"].prod(-1) // 4).tolist())
    out = []
    for token in ids:
        out += [token] * next(counts) if token == IMAGE else [token]
    return out


CASES = [
    # (image places, image sizes): one image, two of different sizes, a wide one whose
    # tokens outnumber its columns, the image first in the prompt.
    ({3}, [(40, 24)]),
    ({1, 8}, [(20, 44), (48, 30)]),
    ({5}, [(100, 18)]),
    ({0}, [(16, 16)]),
]


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=64),
        # Chunks of 7 split images; block-sized prefix-cache hits.
        dict(max_num_batched_tokens=7, enable_prefix_caching=True),
    ],
)
def test_image_prompts_match_transformers_through_llm(vlm, settings):
    hf, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, **settings)
    llm.engine.runner.vision.max_images_per_batch = 2
    g = torch.Generator().manual_seed(7)
    cases = []
    for places, sizes in CASES:
        text = torch.randint(0, 200, (12,), generator=g).tolist()
        images = [png_bytes(w, h, seed=w * h) for w, h in sizes]
        cases.append((_prompt(text, places), images))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=VOCAB)
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases
    ]
    outputs = llm.generate(prompts, params)
    for (ids, images), out in zip(cases, outputs):
        assert out.error is None
        expanded = _expanded(ids, images)
        assert out.prompt_token_ids == expanded
        assert out.image_tokens == expanded.count(IMAGE)
        want_tokens, want_logprobs = _hf_run(hf, expanded, images, 6)
        assert out.outputs[0].token_ids == want_tokens
        got = torch.tensor([[entry[t] for t in range(VOCAB)] for entry in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want_logprobs, atol=2e-3, rtol=0)
