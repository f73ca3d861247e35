"""Jobs over images on a tiny random Qwen2.5-VL (fp32), whose images are as many tokens
as their sizes make: a Parquet image column and an OpenAI batch file with data URLs give
the same prompt tokens and greedy outputs as `LLM.chat` on the same images (which
tests/engine/test_qwen_vl_model.py holds to transformers), each image's tokens are
transformers' processor's count for its size, and a dry run counts them exactly from the
images' headers."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import test_qwen_vl_model as qwen  # noqa: E402
from vision_models import png_bytes  # noqa: E402

from tokenmill.engine import LLM, SamplingParams  # noqa: E402
from tokenmill.pipelines.job import run_job  # noqa: E402
from tokenmill.pipelines.output import read_results  # noqa: E402

ENGINE = {"kv_cache_memory": 8 << 20, "block_size": 4}
# Qwen2.5-VL's chat template's shape: an image part is vision_start, image_pad, vision_end.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKERS = {
    "<|vision_start|>": qwen.VSTART,
    "<|vision_end|>": qwen.VEND,
    "<|image_pad|>": qwen.IMAGE,
    "<|im_start|>": 248,
    "<|im_end|>": 249,
}
# (width, height): sizes whose token counts differ - resized up, kept, resized down.
SIZES = [(9, 7), (30, 17), (21, 40), (90, 60)]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models

    out = tmp_path_factory.mktemp("qwen-vl-jobs")
    config = transformers.Qwen2_5_VLConfig(
        text_config=qwen._text_config(),
        vision_config=qwen.VISION,
        image_token_id=qwen.IMAGE,
        vision_start_token_id=qwen.VSTART,
        vision_end_token_id=qwen.VEND,
        video_token_id=253,
    )
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    qwen.hf_processor().save_pretrained(out)
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .\n")
    vocab = {c: i for i, c in enumerate(chars)}
    taken = set(MARKERS.values())
    vocab.update({f"<unused{i}>": i for i in range(len(chars), qwen.VOCAB) if i not in taken})
    vocab.update(MARKERS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in MARKERS])
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": None, "chat_template": CHAT_TEMPLATE})
    )
    return out


def _hf_tokens(width: int, height: int) -> int:
    """transformers' processor's token count for an image of this size."""
    from PIL import Image

    grid = qwen.hf_processor()(images=[Image.new("RGB", (width, height))])["image_grid_thw"]
    return int(grid.prod()) // 4


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _content(images: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(i)}} for i in images]
    return [*parts, {"type": "text", "text": text}]


def test_a_parquet_image_column_answers_as_llm_chat_does_with_each_images_own_count(vlm, tmp_path):
    images = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    counts = [_hf_tokens(w, h) for w, h in SIZES]
    assert len(set(counts)) == len(counts)  # the sizes make different counts
    rows = [
        ("a", "describe it", [images[0]]),
        ("b", "compare them", [images[1], images[2]]),
        ("c", "big one", [images[3]]),
        ("d", "flat", [png_bytes(400, 1, seed=9)]),  # aspect ratio over 200: refused
    ]
    source = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in rows],
                "text": [r[1] for r in rows],
                "image": pa.array([r[2] for r in rows], pa.list_(pa.binary())),
            }
        ),
        source,
    )
    options = dict(
        prompt_column="text",
        id_column="id",
        image_column="image",
        max_tokens=4,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
    )
    ledger = run_job(str(source), str(tmp_path / "out"), model=str(vlm), **options)
    results = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.chat([[{"role": "user", "content": _content(i, t)}] for _, t, i in rows[:3]], params)
    for (rid, _, _), expected, tokens in zip(
        rows, want, [counts[0], counts[1] + counts[2], counts[3]]
    ):
        got = results[rid]
        assert got["error"] is None and got["finish_reason"] == "length"
        assert got["output"] == expected.outputs[0].text
        assert got["prompt_tokens"] == len(expected.prompt_token_ids)
        assert got["image_tokens"] == tokens == expected.prompt_token_ids.count(qwen.IMAGE)
    assert "aspect ratio over 200" in results["d"]["error"]
    assert ledger.image_tokens == sum(counts)
    assert ledger.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)

    forecast = run_job(
        str(source),
        str(tmp_path / "dry"),
        model=str(vlm),
        dry_run=True,
        calibrate=False,
        **options,
    )
    assert forecast.rows_failed == 1
    assert forecast.image_tokens == sum(counts)
    assert forecast.prompt_tokens == ledger.prompt_tokens


def _raw_job(vlm, tmp_path, name, texts, images, **options) -> list[dict]:
    source = tmp_path / f"{name}.parquet"
    cells = pa.array([images] * len(texts), pa.list_(pa.binary()))
    pq.write_table(pa.table({"text": texts, "image": cells}), source)
    run_job(
        str(source),
        str(tmp_path / name),
        model=str(vlm),
        raw=True,
        image_column="image",
        max_tokens=3,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
        **options,
    )
    return read_results(str(tmp_path / name)).to_pylist()


def test_raw_text_places_each_image_with_its_own_count(vlm, tmp_path):
    """Raw text that places no image gets vision_start, image_pad, vision_end per image
    before it, as the chat template writes them; a template that places them keeps its
    places."""
    small, big = png_bytes(*SIZES[0], seed=1), png_bytes(*SIZES[3], seed=2)
    place = "<|vision_start|><|image_pad|><|vision_end|>"
    before = _raw_job(vlm, tmp_path, "before", ["no place"], [small, big], prompt_column="text")
    placed = _raw_job(vlm, tmp_path, "placed", ["here"], [big], template=f"at {place} {{text}}")
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [
        {"prompt": place * 2 + "no place", "multi_modal_data": {"image": [small, big]}},
        {"prompt": f"at {place} here", "multi_modal_data": {"image": [big]}},
    ]
    want = llm.generate(prompts, params)
    counts = [_hf_tokens(*SIZES[0]) + _hf_tokens(*SIZES[3]), _hf_tokens(*SIZES[3])]
    for got, expected, tokens in zip(before + placed, want, counts):
        assert got["error"] is None
        assert got["output"] == expected.outputs[0].text
        assert got["prompt_tokens"] == len(expected.prompt_token_ids)
        assert got["image_tokens"] == tokens


def test_an_openai_batch_file_with_data_urls_answers_as_llm_chat_does(vlm, tmp_path):
    one, two = png_bytes(*SIZES[1], seed=5), png_bytes(*SIZES[2], seed=6)
    contents = {
        "one": _content([one], "look"),
        "two": _content([two, one], "which"),
    }
    lines = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": c}], "max_tokens": 4},
        }
        for cid, c in contents.items()
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_job(
        str(source),
        str(tmp_path / "out"),
        model=str(vlm),
        format="openai-batch",
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
    )
    results = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.chat([[{"role": "user", "content": c}] for c in contents.values()], params)
    counts = {"one": _hf_tokens(*SIZES[1]), "two": _hf_tokens(*SIZES[2]) + _hf_tokens(*SIZES[1])}
    for cid, expected in zip(contents, want):
        assert results[cid]["error"] is None
        assert results[cid]["output"] == expected.outputs[0].text
        assert results[cid]["prompt_tokens"] == len(expected.prompt_token_ids)
        assert results[cid]["image_tokens"] == counts[cid]


def test_expanded_and_unexpanded_token_ids_run_the_same(vlm):
    """A planner's ids (each image_pad already repeated to its image's count) and vLLM's
    (one image_pad per image) are the same prompt to the engine; a run of another length
    is an error output."""
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    image = png_bytes(*SIZES[1], seed=3)
    n = _hf_tokens(*SIZES[1])
    head, tail = [1, 2, qwen.VSTART], [qwen.VEND, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(
        [
            {"prompt_token_ids": [*head, ids, *tail], "multi_modal_data": {"image": [image]}}
            for ids in (qwen.IMAGE,)
        ]
        + [
            {
                "prompt_token_ids": [*head, *[qwen.IMAGE] * k, *tail],
                "multi_modal_data": {"image": [image]},
            }
            for k in (n, n + 1)
        ],
        params,
    )
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids
    assert outputs[0].prompt_token_ids.count(qwen.IMAGE) == n
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert "image tokens outside an image's place" in outputs[2].error


def test_a_notebook_takes_an_image_column_of_mixed_sizes_as_llm_chat_does(vlm):
    import polars as pl

    import tokenmill

    small, big = png_bytes(*SIZES[0], seed=7), png_bytes(*SIZES[3], seed=8)
    frame = pl.DataFrame({"prompt": ["say", "say", "bad"], "image": [small, big, b"?"]})
    got = tokenmill.generate(
        frame,
        model=str(vlm),
        image_column="image",
        max_tokens=4,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
    )
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.chat(
        [[{"role": "user", "content": _content([i], "say")}] for i in (small, big)], params
    )
    assert got["output"].to_list()[:2] == [w.outputs[0].text for w in want]
    assert got["prompt_tokens"].to_list()[:2] == [len(w.prompt_token_ids) for w in want]
    assert got["prompt_tokens"][1] - got["prompt_tokens"][0] == (
        _hf_tokens(*SIZES[3]) - _hf_tokens(*SIZES[0])
    )
    assert "not an image in a format Pillow reads" in got["error"][2]
