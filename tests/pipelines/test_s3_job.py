"""A batch job reading from and writing to a real S3-protocol server on loopback (moto)."""

from __future__ import annotations

import io
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from click.testing import CliRunner

from tokenmill.cli import main
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_ledger, read_ledger_dataset, read_results

pytestmark = pytest.mark.integration

ENGINE = {"kv_cache_memory": 8 << 20}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from tokenmill.engine.api.llm import LLM

    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", **ENGINE)


def _upload(s3, key, table):
    buf = io.BytesIO()
    pq.write_table(table, buf)
    s3fs.S3FileSystem(**s3.storage_options).pipe(s3.url(key), buf.getvalue())
    return s3.url(key)


def test_s3_in_s3_out_with_resume(s3, tiny_llm):
    prefix = f"job-{uuid.uuid4().hex[:8]}"
    prompts = [f"Numbers: {i} " * (1 + i % 3) for i in range(12)] + [None]
    src = _upload(s3, f"{prefix}/in/data.parquet", pa.table({"prompt": prompts}))
    out = s3.url(f"{prefix}/out")
    ledger_ds = s3.url(f"{prefix}/ledgers")
    # moto accepts any credentials: a distinctive secret can be searched for afterwards
    opts = {**s3.storage_options, "secret": "sekrit-7f3a9"}
    ledger = run_job(
        src,
        out,
        llm=tiny_llm,
        storage_options=opts,
        max_tokens=3,
        shard_tokens=60,
        ledger_dataset=ledger_ds,
    )
    results = read_results(out, opts)
    assert results.num_rows == 13 and len(set(results["id"].to_pylist())) == 13
    assert (ledger.rows_ok, ledger.rows_failed) == (12, 1)
    assert read_ledger(out, opts) == ledger
    assert ledger.completion_tokens == sum(results["completion_tokens"].to_pylist()) == 36
    assert read_ledger_dataset(ledger_ds, opts)["job_id"].to_pylist() == [ledger.job_id]
    fs = s3fs.S3FileSystem(**opts)
    assert len(fs.ls(out.removeprefix("s3://") + "/results")) == ledger.num_shards > 1
    # credentials never reach anything the job wrote
    for path in fs.find(f"{s3.bucket}/{prefix}"):
        assert b"sekrit-7f3a9" not in fs.cat(path), path

    again = run_job(
        src,
        out,
        llm=tiny_llm,
        storage_options=opts,
        max_tokens=3,
        shard_tokens=60,
        ledger_dataset=ledger_ds,
    )
    assert again.num_shards_run == 0 and again.prompt_tokens == ledger.prompt_tokens
    assert read_ledger_dataset(ledger_ds, opts).num_rows == 1


def test_s3_missing_input_fails_clearly(s3, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "run",
            s3.url("nowhere/data.parquet"),
            str(tmp_path / "out"),
            "--storage-option",
            f"endpoint_url={s3.endpoint_url}",
            "--storage-option",
            "key=testing",
            "--storage-option",
            "secret=testing",
        ],
    )
    assert result.exit_code == 1
    assert "nowhere/data.parquet" in result.output and "Traceback" not in result.output


def test_s3_plan_files_in_windows_then_removed(s3, fake_llm):
    from tokenmill.pipelines.job import finalize_job, plan_job, prepare_output, run_shard
    from tokenmill.pipelines.spec import JobSpec

    prefix = f"job-{uuid.uuid4().hex[:8]}"
    ids = [f"r{i}" for i in range(10)]
    src = _upload(s3, f"{prefix}/in/data.parquet", pa.table({"id": ids, "prompt": ids}))
    out = s3.url(f"{prefix}/out")
    opts = s3.storage_options
    fs = s3fs.S3FileSystem(**opts)
    plan_dir = f"{s3.bucket}/{prefix}/out/_plan"

    spec = JobSpec(src, out, id_column="id", plan_window_rows=4, storage_options=opts)
    plan = plan_job(spec, llm=fake_llm)
    assert {s.window for s in plan.shards} == {0, 1, 2}
    on_s3 = {p.rsplit("/", 1)[1].removesuffix(".parquet") for p in fs.ls(plan_dir)}
    assert on_s3 == {s.shard_id for s in plan.shards}
    prepare_output(plan)
    for shard in plan.shards:
        run_shard(fake_llm, plan, shard)
    finalize_job(plan)
    assert sorted(read_results(out, opts)["id"].to_pylist()) == sorted(ids)
    fs.invalidate_cache()
    assert not fs.exists(plan_dir)

    duplicated = _upload(s3, f"{prefix}/in/dup.parquet", pa.table({"id": ids + ["r1"]}))
    # Another input into the same output: without resume=False the changed-input check
    # (tests/faults/test_changed_input.py) refuses it before the ids are read.
    bad = JobSpec(
        duplicated,
        out,
        id_column="id",
        prompt_column="id",
        plan_window_rows=4,
        storage_options=opts,
        resume=False,
    )
    with pytest.raises(ValueError, match=r"1 duplicate id\(s\) in column 'id': 'r1'"):
        plan_job(bad, llm=fake_llm)
    fs.invalidate_cache()
    assert not fs.find(plan_dir)
