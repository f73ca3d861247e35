"""Images given as bytes are decoded beside the loop, a bounded number ahead of the
scheduler (core/image_prefetch.py), and dropped once the tower has encoded them: the
answers are those of images decoded up front, a queue of many image requests never
holds all their pixels, and an image that fails only at decode is its request's error."""

from __future__ import annotations

import io

import pytest
from hf_models import save_char_tokenizer
from PIL import Image
from vision_models import BOI, TOKENS_PER_IMAGE, DecodedPixels, build_gemma3_vlm, png_bytes

from tokenmill.engine import LLM, SamplingParams
from tokenmill.engine.loader.images import image_size
from tokenmill.engine.types.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
MAX_BATCHED_TOKENS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-vlm-prefetch")
    build_gemma3_vlm(out)
    save_char_tokenizer(out, 256)
    return out


def _llm(model_dir) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
    )


def _prompt(image, first: int) -> dict:
    return {
        "prompt_token_ids": [first, BOI, first + 1, first + 2],
        "multi_modal_data": {"image": image},
    }


def test_a_long_queue_of_images_holds_a_bounded_number_decoded(model_dir, monkeypatch):
    num = 3 * EngineConfig.max_images_ahead
    images = [png_bytes(20 + i % 7, 24, seed=i) for i in range(num)]
    llm = _llm(model_dir)
    # Reference: the same images given as PIL images, which are resized up front.
    eager = llm.generate(
        [_prompt(Image.open(io.BytesIO(b)), 10 + i % 20) for i, b in enumerate(images)], GREEDY
    )

    decoded = DecodedPixels(monkeypatch)
    lazy = llm.generate([_prompt(b, 10 + i % 20) for i, b in enumerate(images)], GREEDY)

    assert [o.outputs[0].token_ids for o in lazy] == [o.outputs[0].token_ids for o in eager]
    assert len(decoded.alive) == num  # each image decoded once
    # The images decoded ahead, and those of one step beyond them.
    bound = EngineConfig.max_images_ahead + MAX_BATCHED_TOKENS // TOKENS_PER_IMAGE
    assert 0 < decoded.most <= bound < num
    assert all(ref() is None for ref in decoded.alive)  # none left once answered


def test_an_image_that_fails_only_at_decode_is_its_request_error(model_dir):
    good = [png_bytes(30, 30, seed=s) for s in range(4)]
    truncated = good[1][: len(good[1]) // 2]
    assert image_size(truncated) == (30, 30)  # its header is whole: it queues
    llm = _llm(model_dir)
    prompts = [_prompt(b, 10 + i) for i, b in enumerate(good)]
    clean = llm.generate(prompts, GREEDY)
    outs = llm.generate([*prompts[:1], _prompt(truncated, 11), *prompts[1:]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length", "length"]
    assert outs[1].error.startswith("image: image is truncated or corrupt")
    answered = [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1]
    assert answered == [o.outputs[0].token_ids for o in clean]
