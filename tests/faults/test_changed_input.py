"""An input changed between a kill and the resume: the input fingerprint stored with
the results (OUTPUT/_input.json) refuses to mix old and new rows, and says how to
start fresh; --no-resume then replaces the results."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from fault_jobs import write_input


def test_changed_input_is_refused_after_a_kill_then_no_resume_starts_fresh(fault_job):
    killed = fault_job.run("write@/results/:2")
    assert killed.killed and len(fault_job.published_parts()) == 1
    fingerprint = json.loads((fault_job.output / "_input.json").read_text())
    assert fingerprint[0]["file"] == str(fault_job.input) and fingerprint[0]["size"] > 0

    # Same ids, new prompts and more rows: the old part's shard may still be in the plan,
    # so only the fingerprint stands between the two inputs' rows.
    write_input(fault_job.input, fault_job.num_rows + 4, variant="-v2")
    refused = fault_job.run()
    assert refused.returncode == 1
    assert "the input changed since the results in" in refused.output
    assert "changed size" in refused.output or "was modified" in refused.output
    assert "--no-resume" in refused.output and "new output location" in refused.output
    assert len(fault_job.published_parts()) == 1  # nothing was touched

    fresh = fault_job.run(None, "--no-resume")
    assert fresh.returncode == 0, fresh.output[-2000:]
    fault_job.num_rows += 4
    outcome = fault_job.outcome()
    assert outcome.ok
    prompts = pq.read_table(fault_job.input)["prompt"].to_pylist()
    assert all("-v2" in p for p in prompts)
    assert json.loads((fault_job.output / "_input.json").read_text()) != fingerprint


@pytest.mark.slow
def test_unchanged_input_resumes_and_touched_input_is_refused(fault_job):
    assert fault_job.run("write@/results/:1").killed
    assert fault_job.run().returncode == 0  # same input: resumes
    assert fault_job.outcome().ok
    write_input(fault_job.input)  # same rows, rewritten: a new mtime
    refused = fault_job.run()
    assert refused.returncode == 1 and "was modified" in refused.output


@pytest.mark.slow
def test_changed_input_with_no_part_published_just_starts_over(fault_job):
    assert fault_job.run("write@/results/:1").killed  # killed writing its first part
    assert fault_job.published_parts() == []
    write_input(fault_job.input, fault_job.num_rows, variant="-v2")
    assert fault_job.run().returncode == 0  # nothing to mix: no refusal
    prompts = set(pq.read_table(fault_job.input)["prompt"].to_pylist())
    assert all("-v2" in p for p in prompts)
    assert fault_job.outcome().ok


def test_changed_s3_object_is_refused(s3, tiny_model_dir, tmp_path):
    import time

    import s3fs

    from tokenmill.pipelines.job import run_job

    fs = s3fs.S3FileSystem(**s3.storage_options)
    prefix = f"{s3.bucket}/changed-{time.time_ns()}"
    local = write_input(tmp_path / "in.parquet", 8)
    fs.put_file(str(local), f"{prefix}/in.parquet")
    options = dict(
        model=str(tiny_model_dir),
        id_column="id",
        max_tokens=2,
        dtype="float32",
        engine_options={"kv_cache_memory": 8 << 20},
        storage_options=s3.storage_options,
    )
    src, out = f"s3://{prefix}/in.parquet", f"s3://{prefix}/out"
    run_job(src, out, **options)
    stored = json.loads(fs.cat_file(f"{prefix}/out/_input.json"))
    assert stored[0]["version"] and stored[0]["file"] == src  # the object's ETag
    write_input(local, 8, variant="-v2")  # same size class, new bytes: a new ETag
    fs.put_file(str(local), f"{prefix}/in.parquet")
    with pytest.raises(ValueError, match=r"the input changed since the results in s3://"):
        run_job(src, out, **options)
    ledger = run_job(src, out, resume=False, **options)
    assert ledger.rows_ok + ledger.rows_failed == 8
