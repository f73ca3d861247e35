"""What keeps an image job's memory flat however many rows it has: while a job of 200
image rows runs, the images decoded and not yet encoded never outnumber the engine's
decode-ahead bound (`max_images_ahead`, given as the job's engine option) plus one step's
images, each image is decoded once, and none is left once the job ends.
(benchmarks/images_job_scale.py measures the peak RSS this bounds on thousands of rows.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # vision_models

from vision_models import (  # noqa: E402
    TOKENS_PER_IMAGE,
    DecodedPixels,
    build_gemma3_vlm,
    png_bytes,
    save_marker_tokenizer,
)

from tokenmill.pipelines.job import run_job  # noqa: E402
from tokenmill.pipelines.output import read_results  # noqa: E402

NUM_ROWS = 200
MAX_BATCHED_TOKENS = 256
MAX_IMAGES_AHEAD = 4  # below the default 16: the job's engine_options reach the pool


def test_a_200_image_job_holds_a_bounded_number_of_decoded_images(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    build_gemma3_vlm(model)
    save_marker_tokenizer(model)
    images = [png_bytes(20 + i % 13, 18 + i % 11, seed=i) for i in range(NUM_ROWS)]
    source = tmp_path / "in.parquet"
    ids = [f"r{i:03d}" for i in range(NUM_ROWS)]
    pq.write_table(pa.table({"id": ids, "text": ["describe it"] * NUM_ROWS, "image": images}), source)  # fmt: skip

    decoded = DecodedPixels(monkeypatch)
    run_job(
        str(source),
        str(tmp_path / "out"),
        model=str(model),
        raw=True,
        prompt_column="text",
        id_column="id",
        image_column="image",
        max_tokens=2,
        ignore_eos=True,
        dtype="float32",
        engine_options={
            "kv_cache_memory": 8 << 20,
            "block_size": 4,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "max_images_ahead": MAX_IMAGES_AHEAD,
        },
    )
    rows = read_results(str(tmp_path / "out")).to_pylist()
    assert sorted(r["id"] for r in rows) == ids
    assert all(r["error"] is None and r["image_tokens"] == TOKENS_PER_IMAGE for r in rows)
    assert len(decoded.alive) == NUM_ROWS  # each image decoded once
    # Decoded ahead, and those of one step beyond them: never the job's 200.
    bound = MAX_IMAGES_AHEAD + MAX_BATCHED_TOKENS // TOKENS_PER_IMAGE
    assert 1 < decoded.most <= bound < NUM_ROWS
    assert all(ref() is None for ref in decoded.alive)  # none held once the job ended
