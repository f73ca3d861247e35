"""Jobs over an image column on a tiny random Gemma 3 vision model (fp32): the same prompt
ids and greedy tokens as `LLM.chat` on the same images (which tests/engine/
test_gemma3_vision.py holds to transformers), bad images as error rows naming what is
wrong while every other row is answered, identical (image, prompt) rows computed once,
and images carried in the plan files."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # vision_models

from vision_models import (  # noqa: E402
    IMAGE,
    TOKENS_PER_IMAGE,
    build_gemma3_vlm,
    png_bytes,
    save_chat_marker_tokenizer,
)

from tokenmill.engine import LLM, SamplingParams  # noqa: E402
from tokenmill.pipelines.images import ImageAccess, read_row_images  # noqa: E402
from tokenmill.pipelines.job import run_job  # noqa: E402
from tokenmill.pipelines.output import read_results  # noqa: E402
from tokenmill.pipelines.spill import shard_rows, shard_table  # noqa: E402
from tokenmill.pipelines.tokenize import PromptRow  # noqa: E402

ENGINE = {"kv_cache_memory": 8 << 20, "block_size": 4}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-vlm")
    build_gemma3_vlm(out)
    save_chat_marker_tokenizer(out)
    return out


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_a_parquet_image_column_answers_as_llm_chat_does(vlm, tmp_path):
    one, two, three = (png_bytes(30 + 9 * i, 25 + 4 * i, seed=i) for i in range(3))
    root = tmp_path / "images"
    root.mkdir()
    (root / "three.png").write_bytes(three)
    (tmp_path / "secret.png").write_bytes(one)
    rows = [
        ("a", "describe it", [one]),
        ("b", "compare them", [two, str(root / "three.png")]),
        ("c", "describe it", [one]),  # the same image and prompt as a: computed once
        ("d", "not an image", [b"plain text, no image here"]),
        ("e", "truncated", [png_bytes(40, 40, seed=7)[:90]]),
        ("f", "escape", [str(root / ".." / "secret.png")]),
        ("g", "fetch", ["https://example.com/x.png"]),
        ("h", "too big", [png_bytes(120, 100, seed=8)]),
    ]
    # Bytes and paths in one column, as a Hugging Face datasets Image column stores them.
    cells = [[{"path": p} if isinstance(p, str) else {"bytes": p} for p in r[2]] for r in rows]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    source = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in rows],
                "text": [r[1] for r in rows],
                "image": pa.array(cells, pa.list_(struct)),
            }
        ),
        source,
    )
    out = tmp_path / "out"
    ledger = run_job(
        str(source),
        str(out),
        model=str(vlm),
        prompt_column="text",
        id_column="id",
        image_column="image",
        image_root=[str(root)],
        max_image_pixels=10_000,
        max_tokens=5,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
    )
    results = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert sorted(results) == [r[0] for r in rows]

    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    *({"type": "image_url", "image_url": {"url": _data_url(i)}} for i in imgs),
                    {"type": "text", "text": text},
                ],
            }
        ]
        for text, imgs in (("describe it", [one]), ("compare them", [two, three]))
    ]
    want = llm.chat(conversations, params)
    for rid, expected, num_images in (("a", want[0], 1), ("b", want[1], 2)):
        got = results[rid]
        assert got["error"] is None and got["finish_reason"] == "length"
        assert got["output"] == expected.outputs[0].text
        assert got["prompt_tokens"] == len(expected.prompt_token_ids)
        assert expected.prompt_token_ids.count(IMAGE) == num_images * TOKENS_PER_IMAGE
    assert results["c"]["output"] == results["a"]["output"]
    assert results["c"]["duplicate_of"] == "a" and results["c"]["prompt_tokens"] == 0
    errors = {rid: results[rid]["error"] for rid in "defgh"}
    assert all(results[rid]["finish_reason"] == "error" for rid in "defgh")
    assert "not an image in a format Pillow reads" in errors["d"]
    assert "truncated or corrupt" in errors["e"]
    assert "outside the image roots" in errors["f"]
    assert "URL scheme 'https' is not allowed" in errors["g"]
    assert "120x100 = 12000 pixels, over the limit of 10000" in errors["h"]
    assert ledger.rows_failed == 5
    # Cost truth: image tokens inside prompt_tokens, per row and in the ledger; a dry run
    # counts them (and every prompt token) exactly, from the plan alone.
    assert [results[rid]["image_tokens"] for rid in "abcdefgh"] == [16, 32, 0, 0, 0, 0, 0, 0]
    assert ledger.image_tokens == 48
    assert ledger.prompt_tokens == results["a"]["prompt_tokens"] + results["b"]["prompt_tokens"]
    forecast = run_job(
        str(source),
        str(tmp_path / "dry"),
        model=str(vlm),
        prompt_column="text",
        id_column="id",
        image_column="image",
        image_root=[str(root)],
        max_image_pixels=10_000,
        max_tokens=5,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
        dry_run=True,
        calibrate=False,
    )
    # The truncated image passes its header check: only decoding it finds it out, so the
    # forecast counts its row (as many tokens as any one-image row of its text).
    truncated = llm.chat(
        [
            [
                {
                    "role": "user",
                    "content": [
                        conversations[0][0]["content"][0],
                        {"type": "text", "text": "truncated"},
                    ],
                }
            ]
        ],
        params,
    )
    assert forecast.rows_failed == 4
    assert forecast.image_tokens == 48 + TOKENS_PER_IMAGE
    assert forecast.prompt_tokens == ledger.prompt_tokens + len(truncated[0].prompt_token_ids)


def _raw_job(vlm, tmp_path, name, texts, image, **options) -> list[dict]:
    source = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table({"text": texts, "image": [image] * len(texts)}), source)
    out = tmp_path / name
    run_job(
        str(source),
        str(out),
        model=str(vlm),
        raw=True,
        image_column="image",
        max_tokens=3,
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
        **options,
    )
    return sorted(read_results(str(out)).to_pylist(), key=lambda r: r["id"])


def test_raw_text_places_images_at_the_templates_marker_or_before_the_text(vlm, tmp_path):
    image = png_bytes(33, 21, seed=3)
    before = _raw_job(vlm, tmp_path, "before", ["ab cd"], image, prompt_column="text")
    placed = _raw_job(vlm, tmp_path, "placed", ["cd"], image, template="ab <start_of_image> {text}")
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = ["<start_of_image>ab cd", "ab <start_of_image> cd"]
    want = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": image}} for p in prompts], params
    )
    for got, expected in zip(before + placed, want):
        assert got["error"] is None
        assert got["output"] == expected.outputs[0].text
        assert got["prompt_tokens"] == len(expected.prompt_token_ids)
    # A marker in a row's data is data: the image still goes before the text.
    data = _raw_job(vlm, tmp_path, "data", ["ab <start_of_image> cd"], image, prompt_column="text")
    assert data[0]["error"] is None
    assert data[0]["prompt_tokens"] > placed[0]["prompt_tokens"]
    two = _raw_job(
        vlm, tmp_path, "two", ["cd"], image, template="<start_of_image><start_of_image>{text}"
    )
    assert two[0]["error"] == "the prompt places 2 image(s) (begin-of-image markers), the row has 1"


def test_a_notebook_takes_an_image_column_as_a_job_does(vlm):
    import polars as pl

    import tokenmill

    one, two = png_bytes(28, 31, seed=5), png_bytes(17, 40, seed=6)
    frame = pl.DataFrame(
        {"prompt": ["describe it", "describe it", "bad"], "image": [one, two, b"?"]}
    )
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
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(image)}},
                    {"type": "text", "text": "describe it"},
                ],
            }
        ]
        for image in (one, two)
    ]
    want = llm.chat(conversations, params)
    # The same prompt with another image is another request: nothing is deduplicated.
    assert "duplicate_of" not in got.columns
    assert got["output"].to_list()[:2] == [w.outputs[0].text for w in want]
    assert got["prompt_tokens"].to_list()[:2] == [len(w.prompt_token_ids) for w in want]
    assert "not an image in a format Pillow reads" in got["error"][2]


def _chat_line(custom_id: str, content: list) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4},
    }


def test_an_openai_batch_file_with_data_urls_answers_as_llm_chat_does(vlm, tmp_path):
    one, two = png_bytes(26, 35, seed=9), png_bytes(44, 19, seed=10)
    contents = {
        "one": [
            {"type": "text", "text": "look "},
            {"type": "image_url", "image_url": {"url": _data_url(one)}},
            {"type": "text", "text": " and tell"},
        ],
        "two": [
            {"type": "image_url", "image_url": {"url": _data_url(two)}},
            {"type": "image_url", "image_url": {"url": _data_url(one)}},
            {"type": "text", "text": "which"},
        ],
    }
    lines = [_chat_line(cid, content) for cid, content in contents.items()]
    lines += [
        _chat_line("https", [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]),
        _chat_line("path", [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]),
        _chat_line("text", [{"type": "text", "text": "no image"}]),
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run_job(
        str(source),
        str(out),
        model=str(vlm),
        format="openai-batch",
        ignore_eos=True,
        dtype="float32",
        engine_options=ENGINE,
    )
    results = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    llm = LLM(str(vlm), dtype="float32", device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.chat([[{"role": "user", "content": c}] for c in contents.values()], params)
    for cid, expected in zip(contents, want):
        assert results[cid]["error"] is None
        assert results[cid]["output"] == expected.outputs[0].text
        assert results[cid]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert "URL scheme 'https' is not allowed" in results["https"]["error"]
    assert "name the directories images may be read from" in results["path"]["error"]
    assert results["text"]["error"] is None and results["text"]["completion_tokens"] == 4


def test_a_text_model_refuses_an_image_column_before_any_compute(tmp_path):
    from tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hi"], "image": [b"x"]}), source)
    with pytest.raises(ValueError, match="has no vision tower: image_column needs"):
        run_job(str(source), str(tmp_path / "out"), model=str(model), image_column="image")


def test_image_sources_are_refused_by_what_is_wrong(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    good = png_bytes(10, 10, seed=1)
    (root / "ok.png").write_bytes(good)
    (tmp_path / "outside.png").write_bytes(good)
    (root / "link.png").symlink_to(tmp_path / "outside.png")
    addresses = {
        "loopback.test": ["127.0.0.1"],
        "meta.test": ["169.254.169.254"],
        "lan.test": ["10.1.2.3"],
        "v6.test": ["::1"],
    }
    access = ImageAccess(
        roots=(str(root),), url_schemes=("https", "s3"), resolve=lambda host: addresses[host]
    )
    cells = [
        good,
        [str(root / "ok.png"), _data_url(good)],
        f"file://{root}/ok.png",
        str(root / "link.png"),
        str(root / ".." / "outside.png"),
        "https://loopback.test/a.png",
        "https://meta.test/latest",
        "https://lan.test/a.png",
        "https://v6.test/a.png",
        "ftp://example.com/a.png",
        None,
        [],
        [good, 3],
        "data:image/png,notbase64",
    ]
    found = read_row_images(cells, access)
    assert [len(f.data) for f in found[:3]] == [1, 2, 1]
    assert found[1].data == (good, good) and found[1].hashes[0] == found[0].hashes[0]
    errors = [f.error for f in found[3:]]
    assert errors[0].startswith("image: path ") and "outside the image roots" in errors[0]
    assert "outside the image roots" in errors[1]
    assert "resolves to 127.0.0.1" in errors[2]
    assert "resolves to 169.254.169.254" in errors[3]
    assert "resolves to 10.1.2.3" in errors[4]
    assert "resolves to ::1" in errors[5]
    assert "URL scheme 'ftp' is not allowed" in errors[6]
    assert errors[7:] == [
        "image is null",
        "image list is empty",
        "image 1: must be bytes, a path or a URL, not int",
        "image: a data: image URL must be base64 (data:image/...;base64,...)",
    ]
    no_roots = read_row_images([str(root / "ok.png")], ImageAccess())
    assert "name the directories images may be read from with image_root" in no_roots[0].error
    with pytest.raises(ValueError, match="may not name 'file'"):
        ImageAccess(url_schemes=("file",))


def test_hostile_images_are_refused_at_planning(tmp_path):
    """The fault matrix's hostile images (tests/faults/fault_jobs.py), read as a job reads
    them: every one refused but the truncated PNG, whose header is whole (its decoding
    fails: an error row when it runs, as the job test above shows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
    from fault_jobs import hostile_images

    root = tmp_path / "images"
    root.mkdir()
    access = ImageAccess(roots=(str(root),), max_pixels=1_000_000)
    found = read_row_images(hostile_images(root), access)
    assert [f.error is None for f in found] == [False, False, True, False, False]
    assert "refused as a decompression bomb" in found[0].error
    assert "2000x1000 = 2000000 pixels, over the limit of 1000000" in found[1].error
    assert "not an image in a format Pillow reads" in found[3].error
    assert "outside the image roots" in found[4].error


def test_images_travel_in_the_plan_file():
    rows = [
        PromptRow(0, "a", token_ids=[1, 2], images=(b"one", b"two")),
        PromptRow(1, "b", error="bad"),
        PromptRow(2, "c", token_ids=[3], images=(b"three",)),
    ]
    back = shard_rows(shard_table(rows)).rows
    assert [r.images for r in back] == [(b"one", b"two"), (), (b"three",)]
    assert "images" not in shard_table([PromptRow(0, "a", token_ids=[1])]).column_names
