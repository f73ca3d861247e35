"""SIGKILL the CLI job at random points - planning, mid-shard, part, stats and ledger
writes - resuming after each kill: one row per id, the ledger equal to the rows, and no
temporary file left for a reader of the results."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from fault_jobs import (
    REQUIRED_KINDS,
    FaultJob,
    choose_kill_points,
    kill_and_resume,
    write_input,
)


def test_kinds_cover_the_required_points(fault_rng):
    kinds = choose_kill_points(fault_rng, 6)
    assert len(set(kinds)) == 6 and set(REQUIRED_KINDS) <= set(kinds)
    assert kinds[-1] in ("ledger write", "ledger dataset write")


def test_five_random_kills_then_resume(fault_job, fault_rng):
    specs = kill_and_resume(fault_job, fault_rng, num_points=5)
    outcome = fault_job.outcome()
    seed = f"seed {fault_rng.seed_value}, kills {specs}"
    assert len(specs) >= 4, seed  # at most one kind is skipped when no shard is left
    assert outcome.rows_lost == 0 and outcome.rows_duplicated == 0, seed
    assert outcome.temp_files == [], seed
    assert outcome.ledger_matches, f"{seed}: {outcome.problems}"
    assert outcome.rows_failed == 0, seed
    assert not (fault_job.output / "_plan").exists(), seed
    assert not (fault_job.output / "_lock.json").exists(), seed


@pytest.mark.slow
@pytest.mark.parametrize("round", range(3))
def test_eight_random_kills_then_resume(fault_job, fault_rng, round):
    specs = kill_and_resume(fault_job, fault_rng, num_points=8)
    outcome = fault_job.outcome()
    assert outcome.ok, f"seed {fault_rng.seed_value}, kills {specs}: {outcome}"


@pytest.mark.slow
def test_kill_while_writing_a_part_leaves_its_temp_file_hidden_then_removed(fault_job):
    killed = fault_job.run("write@/results/:2")
    assert killed.killed, killed.output[-1500:]
    results = fault_job.output / "results"
    temps = [p.name for p in results.iterdir() if p.name.startswith(".")]
    assert len(temps) == 1  # the half-published part: hidden, not a part
    assert len(fault_job.published_parts()) == 1
    assert fault_job.run().returncode == 0
    assert fault_job.outcome().ok


@pytest.mark.slow
def test_kill_on_s3_then_resume_takes_over_the_dead_runs_lock(s3, fault_job):
    import json
    import time

    import s3fs

    from tokenmill.pipelines.output import read_ledger, read_results

    fs = s3fs.S3FileSystem(**s3.storage_options)
    prefix = f"{s3.bucket}/kill-{time.time_ns()}"
    fs.put_file(str(fault_job.input), f"{prefix}/in.parquet")
    fault_job.input, fault_job.output = f"s3://{prefix}/in.parquet", f"s3://{prefix}/out"
    fault_job.extra_args = [f"--storage-option={k}={v}" for k, v in s3.storage_options.items()]
    killed = fault_job.run("write@/results/:3")
    assert killed.killed, killed.output[-1500:]
    fs.invalidate_cache()
    holder = json.loads(fs.cat_file(f"{prefix}/out/_lock.json"))  # left by the dead run
    assert len(fs.ls(f"{prefix}/out/results")) == 2
    resumed = fault_job.run()
    assert resumed.returncode == 0, resumed.output[-2000:]
    fs.invalidate_cache()
    assert not fs.exists(f"{prefix}/out/_lock.json") and holder["pid"] != 0
    ids = read_results(fault_job.output, s3.storage_options)["id"].to_pylist()
    assert sorted(ids) == sorted(f"id-{i}" for i in range(fault_job.num_rows))
    ledger = read_ledger(fault_job.output, s3.storage_options)
    assert ledger.num_shards_run == ledger.num_shards - 2


def test_duplicates_are_answered_exactly_once_across_kills(tmp_path, tiny_model_dir):
    """Copies live in copy shards that read their sources' parts: killed while a source
    computes, while a copy part or its stats are written, the job resumes to one row per
    id, every copy with its source's answer and no tokens billed."""
    job = FaultJob(
        tiny_model_dir, write_input(tmp_path / "in.parquet", duplicates=True), tmp_path / "out"
    )
    for spec in (
        "engine_step:3",
        "write@/results/:2",
        "write@/shard_stats/copies-:1",
        "write@/results/copies-:2",
    ):
        result = job.run(spec)
        assert result.killed, f"{spec}: rc {result.returncode}: {result.output[-1500:]}"
    final = job.run()
    assert final.returncode == 0, final.output[-2000:]
    outcome = job.outcome()
    assert outcome.ok, outcome
    prompts = pq.read_table(job.input, columns=["prompt"])["prompt"].to_pylist()
    repeats = len(prompts) - len(set(prompts))
    assert repeats >= 8 and outcome.rows_copied == repeats and outcome.copies_wrong == 0
    ledger = json.loads((job.output / "ledger.json").read_text())
    assert ledger["rows_deduplicated"] == repeats
