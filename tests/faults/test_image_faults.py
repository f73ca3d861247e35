"""An image job (a tiny random Gemma 3 vision model over an image column holding hostile
images among good ones) killed at random points and resumed: one row per id, the
hostile ones error rows naming why, the ledger equal to the rows."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from fault_jobs import kill_and_resume, vision_job


# Its hostile images' refusals are checked fast, without kills, in
# tests/pipelines/test_image_jobs.py (test_hostile_images_are_refused_at_planning).
@pytest.mark.slow
def test_an_image_job_with_hostile_images_survives_kills(fault_job, fault_rng, tmp_path):
    job = vision_job(tmp_path, fault_job)
    specs = kill_and_resume(job, fault_rng, num_points=3)
    outcome = job.outcome()
    seed = f"seed {fault_rng.seed_value}, kills {specs}"
    assert outcome.ok and outcome.rows_failed == 6, f"{seed}: {outcome}"
    rows = pq.read_table(job.output / "results").to_pylist()
    errors = sorted(r["error"] for r in rows if r["error"] is not None)
    assert sum("refused as a decompression bomb" in e for e in errors) == 2, errors
    assert sum("2000x1000 = 2000000 pixels, over the limit of 1000000" in e for e in errors) == 1
    assert sum("truncated or corrupt" in e for e in errors) == 1, errors
    assert sum("not an image in a format Pillow reads" in e for e in errors) == 1, errors
    assert sum("outside the image roots" in e for e in errors) == 1, errors
    assert all(r["image_tokens"] == (16 if r["error"] is None else 0) for r in rows)
