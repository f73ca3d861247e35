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


def _text_config():
    return {
        **SMALL,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": MROPE_SECTION,
        },
    }


def _randomise_tower(model):
    """std 0.05 for the tower's weights and biases, norm scales about 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" not in name:
                continue
            is_norm = any(norm in name for norm in ("norm1.", "norm2.", "ln_q."))
            if is_norm and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.05)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("qwen2-5-vl")
    config = transformers.Qwen2_5_VLConfig(
        text_config=_text_config(),
        vision_config=VISION,
        image_token_id=IMAGE,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        video_token_id=253,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    _randomise_tower(model)
    model.save_pretrained(out, safe_serialization=True)
    hf_processor().save_pretrained(out)
    save_char_tokenizer(out, VOCAB)
    return model, out


_HF_RUNS: dict = {}  # (model, ids, images, num_tokens) -> transformers' answer


def _hf_run(hf, ids, images, num_tokens):
    """Greedy continuation by full forward passes, and the prompt's log-softmax rows."""
    key = (id(hf), tuple(ids), tuple(images), num_tokens)
    if key not in _HF_RUNS:
        _HF_RUNS[key] = _hf_forward(hf, ids, images, num_tokens)
    return _HF_RUNS[key]


def _hf_forward(hf, ids, images, num_tokens):
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
    ("settings", "num_cases"),
    [
        (dict(max_num_batched_tokens=64), len(CASES)),
        # Chunks of 7 split images; block-sized prefix-cache hits.
        (dict(max_num_batched_tokens=7, enable_prefix_caching=True), len(CASES)),
        # One token a step: every prompt token, image tokens too, goes as a one-token
        # chunk (the runner's decode rows).
        (dict(max_num_batched_tokens=1), 2),
    ],
)
def test_image_prompts_match_transformers_through_llm(vlm, settings, num_cases):
    hf, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, **settings)
    llm.engine.runner.vision.max_images_per_batch = 2
    g = torch.Generator().manual_seed(7)
    cases = []
    for places, sizes in CASES[:num_cases]:
        text = torch.randint(0, 200, (12,), generator=g).tolist()
        images = [png_bytes(w, h, seed=w * h) for w, h in sizes]
        cases.append((_prompt(text, places), images))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=VOCAB)
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases
    ]
    outputs = llm.generate(prompts, params)
    # Every image through the tower once, even one split across chunks of many steps.
    assert llm.engine.runner.vision.num_images_encoded == sum(len(i) for _, i in cases)
    for (ids, images), out in zip(cases, outputs):
        assert out.error is None
        expanded = _expanded(ids, images)
        assert out.prompt_token_ids == expanded
        assert out.image_tokens == expanded.count(IMAGE)
        want_tokens, want_logprobs = _hf_run(hf, expanded, images, 6)
        assert out.outputs[0].token_ids == want_tokens
        got = torch.tensor([[entry[t] for t in range(VOCAB)] for entry in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want_logprobs, atol=2e-3, rtol=0)


def test_mrope_positions_equal_transformers_rope_index(vlm):
    """core/mrope.py against transformers' get_rope_index: every token's three positions
    and the delta decode steps continue from, over any range of the prompt (a chunk)."""
    hf, _ = vlm
    # Images of (rows, columns) tokens at their offsets; text around and between them.
    layout = [("text", 3), ((3, 5), None), ("text", 2), ((4, 2), None), ("text", 4)]
    ids, grids, images, index = [], [], [], 0
    for kind, count in layout:
        if kind == "text":
            ids += [7] * count
            index += count
        else:
            rows, columns = kind
            ids += [IMAGE] * (rows * columns)
            grids.append([1, rows * 2, columns * 2])
            images.append(
                ImageSpan(index, rows * columns, b"%d" % index, torch.empty(0), grid=kind)
            )
            index += rows * columns
    input_ids = torch.tensor([ids])
    want, want_delta = hf.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids)
    )
    got = mrope_positions(images, 0, len(ids))
    assert got.tolist() == want[:, 0].tolist()
    assert mrope_delta(images) == int(want_delta) == (5 - 15) + (4 - 8)
    for start, end in [(0, 5), (4, 20), (17, 30), (29, len(ids)), (len(ids), len(ids) + 3)]:
        chunk = mrope_positions(images, start, end)
        if end <= len(ids):
            assert np.array_equal(chunk, got[:, start:end])
        else:  # decode steps: index plus the delta on all three
            assert chunk.tolist() == [list(range(start + mrope_delta(images), end - 14))] * 3


def test_a_prefix_cache_hit_past_an_image_places_later_positions_right(vlm):
    """The same image under the same prefix is served from the cache - the hit ends past
    the image, so every later token's positions come from the delta the image left."""
    hf, model_dir = vlm
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=True
    )
    image = png_bytes(40, 24, seed=5)  # 15 tokens: the delta is 5 - 15
    head = _prompt([30, 31, 32, 33, 34, 35, 36], {2})
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(
        {"prompt_token_ids": head + [40, 41], "multi_modal_data": {"image": image}}, params
    )
    before = llm.stats().cached_prompt_tokens
    ids = head + [50, 51, 52, 53]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params)[0]
    expanded = out.prompt_token_ids
    # Blocks wholly inside the shared part (2 + 3 + 15 - 1 + 5 = 24 tokens) are served.
    assert llm.stats().cached_prompt_tokens - before == 24
    assert llm.engine.runner.vision.num_images_encoded == 1
    assert out.outputs[0].token_ids == _hf_run(hf, expanded, [image], 5)[0]
    # Another image of the same size under the same ids: only the blocks before it.
    other = png_bytes(40, 24, seed=6)
    before = llm.stats().cached_prompt_tokens
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": other}}, params)[0]
    assert llm.stats().cached_prompt_tokens - before == 0  # image_pad sits at 3, in block 0
    assert out.outputs[0].token_ids == _hf_run(hf, out.prompt_token_ids, [other], 5)[0]


def test_preempted_image_prompts_recompute_to_the_same_answers(vlm):
    """A cache too small for every sequence at once: image prompts are preempted and
    recomputed with the same 3D positions (the tower's output reused by content hash)."""
    _, model_dir = vlm
    prompts = [
        {
            "prompt_token_ids": _prompt([20 + i, 21, 22, 23, 24, 25, 26, 27], {1}),
            "multi_modal_data": {"image": png_bytes(40 + 8 * i, 24, seed=i)},
        }
        for i in range(4)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    # 2 layers x (k + v) x 2 kv heads x 16 values x 4 positions x 4 bytes = 2 KiB a block.
    tight = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        kv_cache_memory=24 * 2048,
        max_num_seqs=4,  # set: admitted by their prompt alone, so decode preempts
    )
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    assert tight.engine.runner.vision.num_images_encoded == 4


def test_text_prompts_on_the_vision_model_equal_transformers(vlm):
    hf, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    ids = [5, 9, 33, 2, 80, 14, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=VOCAB)
    out = llm.generate([ids], params)[0]
    want_tokens, want_logprobs = _hf_run(hf, ids, [], 6)
    assert out.outputs[0].token_ids == want_tokens and out.image_tokens == 0
    got = torch.tensor([[entry[t] for t in range(VOCAB)] for entry in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want_logprobs, atol=2e-3, rtol=0)


def test_text_and_chat_prompts_expand_markers_as_transformers_processor(vlm, tmp_path):
    """A text prompt's <|image_pad|> and a chat's image_url part become the image's tokens
    as transformers' Qwen2_5_VLProcessor expands them, tokenized by transformers over a
    tokenizer whose markers are special tokens. (The processor itself cannot be built
    here: its video processor needs torchvision. Its own `replace_image_token` is run on
    the image processor's output, as its __call__ runs it.)"""
    import json
    import shutil
    import types

    from PIL import Image
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor

    _, model_dir = vlm
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    markers = {"<|vision_start|>": VSTART, "<|vision_end|>": VEND, "<|image_pad|>": IMAGE}
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({f"<unused{i}>": i for i in range(len(chars), VOCAB) if i not in markers.values()})
    vocab.update(markers)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in markers])
    backend.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": None, "chat_template": template})
    )
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    images = [png_bytes(44, 20, seed=1), png_bytes(17, 60, seed=2)]
    text = "look <|vision_start|><|image_pad|><|vision_end|> and <|image_pad|> ok"
    image_inputs = hf_processor()(
        [Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
    )
    processor = types.SimpleNamespace(image_processor=hf_processor(), image_token="<|image_pad|>")

    def transformers_ids(prompt: str) -> list[int]:
        pieces = prompt.split("<|image_pad|>")
        expanded = pieces[0]
        for index, piece in enumerate(pieces[1:]):  # as the processor: each marker in order
            expanded += Qwen2_5_VLProcessor.replace_image_token(processor, image_inputs, index)
            expanded += piece
        return hf_tokenizer(expanded)["input_ids"]

    want = transformers_ids(text)
    assert want.count(IMAGE) == int(image_inputs["image_grid_thw"].prod(-1).sum()) // 4
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0]
    assert out.error is None
    assert out.prompt_token_ids == want
    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look "},
                {"type": "image_url", "image_url": {"url": urls[0]}},
                {"type": "text", "text": " and "},
                {"type": "image_url", "image_url": {"url": urls[1]}},
            ],
        }
    ]
    chatted = llm.chat([chat], params)[0]
    assert chatted.error is None
    rendered = "look <|vision_start|><|image_pad|><|vision_end|> and "
    rendered += "<|vision_start|><|image_pad|><|vision_end|>"
    assert chatted.prompt_token_ids == transformers_ids(rendered)
    assert out.image_tokens == chatted.image_tokens == want.count(IMAGE)


def test_bad_images_and_mismatched_markers_are_error_outputs_and_others_answered(vlm):
    _, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    good = png_bytes(30, 30, seed=3)
    ids = _prompt(list(range(10, 20)), {1})
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": good[: len(good) // 2]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": good}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [good, good]}},
        {"prompt_token_ids": [1, IMAGE, IMAGE, 2], "multi_modal_data": {"image": [good, good]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": png_bytes(402, 2, seed=1)}},
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "error"]
    assert "truncated or corrupt" in outs[0].error
    assert "places 1 image(s)" in outs[2].error and "2 were given" in outs[2].error
    assert "outside an image's place" in outs[3].error  # two images side by side
    assert "aspect ratio over 200" in outs[4].error


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
    extra = {**tensors, "model.visual.blocks.3.mlp.gate_proj.weight": torch.zeros(48, 32)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no place for: model\.visual\.blocks\.3\.mlp"):
        load_model(tmp_path, config, **cpu)
    missing = {k: v for k, v in tensors.items() if "merger.ln_q" not in k}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: visual\.merger\.ln_q\.weight"):
        load_model(tmp_path, config, **cpu)


def test_unsupported_settings_are_refused_by_name(vlm):
    import json

    from tokenmill.engine.models import parse_config

    _, model_dir = vlm
    raw = json.loads((model_dir / "config.json").read_text())
    # transformers 4's layout: the text model's fields at the top level.
    flat = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": MROPE_SECTION}
    del flat["rope_parameters"]
    assert parse_config(flat) == parse_config(raw)
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        parse_config({**flat, "use_sliding_window": True, "sliding_window": 8})
    # The older spelling: rope_scaling of type "mrope".
    old = json.loads(json.dumps(raw))
    old["text_config"]["rope_parameters"] = None
    old["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": [3, 3, 2]}
    assert parse_config(old).mrope_section == (3, 3, 2)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2, 2\] must add up to"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_interleaved"] = True
    with pytest.raises(ValueError, match="interleaved M-RoPE"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["vision_config"]["out_hidden_size"] = 32
    with pytest.raises(ValueError, match="out_hidden_size 32 is not the text model's"):
        parse_config(bad)
    with pytest.raises(ValueError, match="cuda_graphs is not supported for Qwen2_5_VL"):
        LLM(str(model_dir), dtype="float32", device="cpu", cuda_graphs=True)


def test_qwen2_vl_matches_transformers_through_llm(tmp_path):
    """Qwen2-VL (LayerNorm tower, quick-GELU MLP, no windows; the same M-RoPE text
    model) with two images of different sizes, chunks splitting them."""
    import transformers

    vision = dict(
        depth=2,
        embed_dim=32,
        mlp_ratio=2,
        num_heads=4,
        hidden_size=SMALL["hidden_size"],
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = transformers.Qwen2VLConfig(
        text_config=_text_config(),
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        video_token_id=253,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(77)
    hf = transformers.Qwen2VLForConditionalGeneration(config).eval()
    _randomise_tower(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf_processor().save_pretrained(tmp_path)
    save_char_tokenizer(tmp_path, VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=9)
    images = [png_bytes(20, 44, seed=4), png_bytes(48, 30, seed=5)]
    ids = _prompt([3, 9, 27, 81, 13, 39, 117, 95, 31, 93], {1, 7})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=VOCAB)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params)[0]
    assert out.error is None
    expanded = _expanded(ids, images)
    assert out.prompt_token_ids == expanded
    want_tokens, want_logprobs = _hf_run(hf, expanded, images, 6)
    assert out.outputs[0].token_ids == want_tokens
    got = torch.tensor([[entry[t] for t in range(VOCAB)] for entry in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want_logprobs, atol=2e-3, rtol=0)


def test_a_checkpoint_with_transformers_4_names_loads_the_same(vlm, tmp_path):
    """Hub checkpoints saved by transformers 4 name the text model `model.` and the tower
    `visual.` (5 writes `model.language_model.` and `model.visual.`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, model_dir = vlm
    for name in ("config.json", "preprocessor_config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in load_file(model_dir / "model.safetensors").items()
    }
    assert any(k.startswith("visual.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    prompt = {
        "prompt_token_ids": _prompt(list(range(10, 20)), {2}),
        "multi_modal_data": {"image": png_bytes(30, 40, seed=8)},
    }
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    answers = [
        LLM(str(d), dtype="float32", device="cpu").generate(prompt, params)[0].outputs[0].token_ids
        for d in (model_dir, tmp_path)
    ]
    assert answers[0] == answers[1]


def test_the_tower_takes_a_steps_images_in_calls_bounded_by_tokens(vlm):
    """Images of their own sizes go to the tower in calls of at most
    max_image_tokens_per_batch tokens (at least one image a call)."""
    hf, model_dir = vlm
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    vision = llm.engine.runner.vision
    vision.max_image_tokens_per_batch = 30
    images = [png_bytes(40, 24, seed=21), png_bytes(20, 44, seed=22), png_bytes(48, 30, seed=23)]
    ids = _prompt([5, 6, 7, 8, 9, 10, 11], {1, 3, 5})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params)[0]
    expanded = _expanded(ids, images)
    # 15, 12 and 24 tokens: [15 + 12] and [24], in one step.
    assert out.image_tokens == 15 + 12 + 24
    assert (vision.num_tower_calls, vision.num_images_encoded) == (2, 3)
    assert out.outputs[0].token_ids == _hf_run(hf, expanded, images, 4)[0]
