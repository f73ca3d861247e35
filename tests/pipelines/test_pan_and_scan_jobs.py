"""A job over an image column with Gemma 3's pan-and-scan on (`--engine-option
pan_and_scan=true`) on a tiny random Gemma 3 vision model (fp32): each row's prompt and
answer as `LLM.chat` gives them with the same setting (which tests/engine/
test_gemma3_pan_and_scan.py holds to transformers), its image tokens counting every crop,
a notebook given the same LLM answering alike, and a dry run counting the same tokens
from the images' sizes alone."""

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
from tokenmill.pipelines.job import run_job  # noqa: E402
from tokenmill.pipelines.output import read_results  # noqa: E402

ENGINE = {"kv_cache_memory": 8 << 20, "block_size": 4}
# (id, text, image sizes): crops 3, 2 + 0, and none.
ROWS = [
    ("a", "describe it", [(90, 30)]),
    ("b", "compare them", [(20, 37), (40, 40)]),
    ("c", "square", [(33, 33)]),
]
CROPS = {"a": 3, "b": 2, "c": 0}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny VLM, its image processor cropping images this small (8 px crops, 3 at
    most) with pan-and-scan itself left null, as Gemma 3's configs leave it."""
    out = tmp_path_factory.mktemp("gemma3-pan-and-scan-jobs")
    build_gemma3_vlm(out)
    save_chat_marker_tokenizer(out)
    processor = json.loads((out / "preprocessor_config.json").read_text())
    processor.update(
        do_pan_and_scan=None,
        pan_and_scan_min_crop_size=8,
        pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


def _job(vlm, source, out, **options):
    return run_job(
        str(source),
        str(out),
        model=str(vlm),
        prompt_column="text",
        id_column="id",
        image_column="image",
        max_tokens=4,
        ignore_eos=True,
        dtype="float32",
        **options,
    )


def test_a_job_with_pan_and_scan_counts_every_crop_and_its_dry_run_too(vlm, tmp_path):
    images = {rid: [png_bytes(w, h, seed=w * h) for w, h in sizes] for rid, _, sizes in ROWS}
    source = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in ROWS],
                "text": [r[1] for r in ROWS],
                "image": [images[r[0]] for r in ROWS],
            }
        ),
        source,
    )
    engine = {**ENGINE, "pan_and_scan": True}
    ledger = _job(vlm, source, tmp_path / "out", engine_options=engine)
    results = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}

    llm = LLM(str(vlm), dtype="float32", device="cpu", **engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    url = "data:image/png;base64,"
    want = llm.chat(
        [
            [
                {
                    "role": "user",
                    "content": [
                        *(
                            {
                                "type": "image_url",
                                "image_url": {"url": url + base64.b64encode(i).decode()},
                            }
                            for i in images[rid]
                        ),
                        {"type": "text", "text": text},
                    ],
                }
            ]
            for rid, text, _ in ROWS
        ],
        params,
    )
    for (rid, _, sizes), expected in zip(ROWS, want):
        got = results[rid]
        assert got["error"] is None
        assert got["output"] == expected.outputs[0].text
        assert got["prompt_tokens"] == len(expected.prompt_token_ids)
        num_views = len(sizes) + CROPS[rid]
        assert got["image_tokens"] == expected.image_tokens == num_views * TOKENS_PER_IMAGE
        assert expected.prompt_token_ids.count(IMAGE) == num_views * TOKENS_PER_IMAGE
    assert ledger.image_tokens == (4 + 4 + 1) * TOKENS_PER_IMAGE

    # A notebook given that LLM places its rows' images as the LLM crops them.
    import polars as pl

    import tokenmill

    frame = pl.DataFrame(
        {"prompt": [r[1] for r in ROWS], "image": [images[r[0]] for r in ROWS]},
        schema={"prompt": pl.String, "image": pl.List(pl.Binary)},
    )
    got = tokenmill.generate(frame, llm=llm, image_column="image", max_tokens=4, ignore_eos=True)
    assert got["output"].to_list() == [w.outputs[0].text for w in want]
    assert got["prompt_tokens"].to_list() == [len(w.prompt_token_ids) for w in want]

    forecast = _job(
        vlm, source, tmp_path / "dry", engine_options=engine, dry_run=True, calibrate=False
    )
    assert forecast.image_tokens == ledger.image_tokens
    assert forecast.prompt_tokens == ledger.prompt_tokens

    # The setting off (the model's config: null), each image is one block.
    plain = _job(
        vlm, source, tmp_path / "plain", engine_options=ENGINE, dry_run=True, calibrate=False
    )
    assert plain.image_tokens == 4 * TOKENS_PER_IMAGE
