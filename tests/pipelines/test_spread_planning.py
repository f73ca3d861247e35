"""Planning spread over two Dask workers makes the local planner's plan, file for file:
the same rows in the same shards, duplicates copied across windows, bad rows as error
rows, duplicate ids refused with the same message, bad files refused before any part
runs, and a resume from the plan files. A tiny model's tokenizer; no model compute."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import pytest
from distributed import Client, LocalCluster

from tokenmill.connectors import SourceError
from tokenmill.flows.runners import DaskFanOut
from tokenmill.pipelines import output as out
from tokenmill.pipelines.job import finalize_job, plan_job, prepare_output, run_shard
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spread_planning import plan_job_spread

NUM_ROWS = 23
WINDOW = 5
BAD_LINE = 12  # not JSON: an error row


@pytest.fixture(scope="module")
def two_workers():
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


@dataclass
class CountingFanOut:
    """DaskFanOut, counting the parts it was asked to run."""

    num_parts: int = 2
    parts_run: list[int] = field(default_factory=list)

    def map(self, fn, args):
        self.parts_run.append(len(args))
        return DaskFanOut(self.num_parts).map(fn, args)


def _input(path, ids=None):
    """Rows on three instructions; questions repeat every 7 rows (copies in other
    windows), one null prompt, one line that is not JSON."""
    ids = ids or [f"k{i}" for i in range(NUM_ROWS)]
    heads = ["System: be brief. ", "Translate: ", ""]
    lines = []
    for i, rid in enumerate(ids):
        prompt = None if i == 9 else heads[i % 7 % 3] + "word " * (1 + i % 7 % 4) + str(i % 7)
        line = json.dumps({"key": rid, "prompt": prompt, "lang": f"l{i}"})
        lines.append('{"key": "broken' if i == BAD_LINE else line)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _spec(src, output, model, **options):
    args = dict(
        model=model,
        id_column="key",
        passthrough=("lang",),
        shard_tokens=60,
        plan_window_rows=WINDOW,
        max_tokens=4,
        temperature=0.0,
    )
    return JobSpec(src, str(output), **{**args, **options})


def _plan_files(output):
    return {p.stem: p.read_bytes() for p in (output / "_plan").glob("*.parquet")}


def _local_then_spread(tmp_path, model, fan_out, **options):
    """(local plan, its plan files, spread plan, its plan files), both into one output
    (a job's id names where it writes)."""
    src = _input(tmp_path / "in.jsonl")
    output = tmp_path / "out"
    local = plan_job(_spec(src, output, model, **options), min_shards=2)
    local_files = _plan_files(output)
    shutil.rmtree(output)
    spread = plan_job_spread(_spec(src, output, model, **options), fan_out=fan_out, min_shards=2)
    return local, local_files, spread, _plan_files(output)


def test_spread_plan_is_the_local_plan(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out
    )
    assert fan_out.parts_run == [2]
    assert spread.shards == local.shards and spread.job_id == local.job_id
    # 21 good rows on 7 distinct prompts: 14 copies
    assert (spread.num_rows, spread.num_failed, spread.rows_deduplicated) == (NUM_ROWS, 2, 14)
    assert (local.num_rows, local.num_failed, local.rows_deduplicated) == (NUM_ROWS, 2, 14)
    assert (spread.rows_read, spread.rows_skipped_blank) == (local.rows_read, 0)
    assert len({s.window for s in spread.shards}) == 5  # 23 rows in windows of 5
    assert any(s.is_copy for s in spread.shards)
    # every plan file byte for byte: rows, order, token ids, errors, passthrough, sources
    assert spread_files == local_files and len(spread_files) == len(spread.shards)
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()  # staging is gone


def test_a_job_it_cannot_spread_is_planned_here_the_same(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out, json_schema_column="lang"
    )
    assert fan_out.parts_run == []  # per-row params: no part ran
    assert spread.shards == local.shards and spread_files == local_files


def test_duplicate_ids_fail_with_the_local_message(tmp_path, tiny_model_dir, two_workers):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[17] = ids[3] = "twice"
    ids[21] = "k2"
    src = _input(tmp_path / "in.jsonl", ids=ids)
    with pytest.raises(ValueError) as local:
        plan_job(_spec(src, tmp_path / "local", str(tiny_model_dir)))
    assert "2 duplicate id(s) in column 'key': 'twice', 'k2'" in str(local.value)
    with pytest.raises(ValueError) as spread:
        plan_job_spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), fan_out=CountingFanOut())
    assert str(spread.value) == str(local.value)
    assert not (tmp_path / "out" / "_plan").exists()
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()


def test_a_bad_file_fails_before_any_part_runs(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    with pytest.raises(SourceError, match="missing.jsonl"):
        plan_job_spread(
            _spec(str(tmp_path / "missing.jsonl"), tmp_path / "out", str(tiny_model_dir)),
            fan_out=fan_out,
        )
    src = _input(tmp_path / "in.jsonl")
    with pytest.raises(SourceError, match="'topic'"):
        plan_job_spread(
            _spec(src, tmp_path / "out", str(tiny_model_dir), passthrough=("topic",)),
            fan_out=fan_out,
        )
    assert fan_out.parts_run == []


def test_resume_from_the_spread_plan_files(tmp_path, tiny_model_dir, fake_llm, two_workers):
    src = _input(tmp_path / "in.jsonl")
    spec = _spec(src, tmp_path / "out", str(tiny_model_dir))
    plan = plan_job_spread(spec, fan_out=CountingFanOut())
    prepare_output(plan)
    for shard in plan.shards[:3]:
        run_shard(fake_llm, plan, shard)
    again = plan_job_spread(spec, fan_out=CountingFanOut())
    assert again.shards == plan.shards and again.job_id == plan.job_id
    done = prepare_output(again)
    assert done == {s.shard_id for s in plan.shards[:3]}
    pending = [s for s in again.shards if s.shard_id not in done]
    for shard in pending:
        run_shard(fake_llm, again, shard)
    ledger = finalize_job(again, num_shards_run=len(pending))
    results = read_results(str(tmp_path / "out"))
    ids = results["id"].to_pylist()
    # each row exactly once; the line that is not JSON under its position id
    expected = [f"k{i}" for i in range(NUM_ROWS) if i != BAD_LINE] + [f"row-{BAD_LINE:09d}"]
    assert sorted(ids) == sorted(expected)
    errors = {r["id"]: r["error"] for r in results.to_pylist() if r["finish_reason"] == "error"}
    assert errors["k9"] == "prompt is null"
    assert f"line {BAD_LINE + 1}: invalid JSON" in errors[f"row-{BAD_LINE:09d}"]
    assert len(errors) == 2
    assert (ledger.rows_ok, ledger.rows_failed) == (NUM_ROWS - 2, 2)


def _plan_on_a_worker(spec: JobSpec) -> list:
    """What the flow's plan task does on its worker: submit the parts from there."""
    return plan_job_spread(spec, fan_out=DaskFanOut(2), min_shards=2).shards


def test_parts_submitted_from_a_task_on_a_one_thread_worker(tmp_path, tiny_model_dir, two_workers):
    # The plan task holds its worker's only thread: waiting on its parts must not
    # starve them (worker_client hands the thread back).
    src = _input(tmp_path / "in.jsonl")
    spec = _spec(src, tmp_path / "out", str(tiny_model_dir))
    local = plan_job(spec, min_shards=2)
    shutil.rmtree(tmp_path / "out")
    shards = two_workers.submit(_plan_on_a_worker, spec, pure=False).result(timeout=120)
    assert shards == local.shards


def test_null_ids_fail_with_the_local_message(tmp_path, tiny_model_dir, two_workers):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[6] = ids[19] = None  # in windows 1 and 3, both read by part 1 of 2
    src = _input(tmp_path / "in.jsonl", ids=ids)
    with pytest.raises(ValueError) as local:
        plan_job(_spec(src, tmp_path / "local", str(tiny_model_dir)))
    assert "is null in 2 row(s) (first at row 6)" in str(local.value)
    with pytest.raises(ValueError) as spread:
        plan_job_spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), fan_out=CountingFanOut())
    assert str(spread.value) == str(local.value)


def test_an_input_changed_under_the_parts_fails(tmp_path, tiny_model_dir, two_workers):
    src = _input(tmp_path / "in.jsonl")

    class GrowingInput(CountingFanOut):
        def map(self, fn, args):  # a line lands after the driver opened the input
            with open(src, "a") as f:
                f.write(json.dumps({"key": "late", "prompt": "late", "lang": "l"}) + "\n")
            return super().map(fn, args)

    with pytest.raises(RuntimeError, match=r"the input changed while it was planned \(.*size"):
        plan_job_spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), fan_out=GrowingInput())
    assert not (tmp_path / "out" / "_plan").exists()
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()
