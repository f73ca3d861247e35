"""Planning spread over two Dask workers, each part reading its own partition of the
input, makes the local planner's plan, file for file: JSON Lines split by byte range,
Parquet by row groups, CSV by file; the same rows in the same shards, duplicates copied
across windows, bad rows as error rows, null and duplicate ids refused with the same
message, bad files refused before any part runs, and a resume from the plan files. A
tiny model's tokenizer; no model compute."""

from __future__ import annotations

import csv
import json
import shutil
import uuid
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
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
# A deduping job's cut on the workers (`spread_cut.py`): 5 windows in 4 runs, cut, then
# placed in the run order
CUT_ROUNDS = [("cut_windows", 4), ("place_windows", 4)]


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
        self.parts_run.append((fn.__name__, len(args)))
        return DaskFanOut(self.num_parts).map(fn, args)

    def imap(self, fn, args):
        self.parts_run.append((fn.__name__, len(args)))
        return DaskFanOut(self.num_parts).imap(fn, args)

    def reading_parts(self) -> list[int]:
        return [n for name, n in self.parts_run if name == "read_part"]


def _prompt(i: int) -> str | None:
    """Rows on three instructions; questions repeat every 7 rows (copies in other
    windows), one null prompt."""
    heads = ["System: be brief. ", "Translate: ", ""]
    return None if i == 9 else heads[i % 7 % 3] + "word " * (1 + i % 7 % 4) + str(i % 7)


def _input(path, ids=None):
    """JSON Lines: `_prompt`'s rows, one line that is not JSON, a blank line."""
    ids = ids or [f"k{i}" for i in range(NUM_ROWS)]
    lines = []
    for i, rid in enumerate(ids):
        line = json.dumps({"key": rid, "prompt": _prompt(i), "lang": f"l{i}"})
        lines.append('{"key": "broken' if i == BAD_LINE else line)
    lines.insert(7, "  ")  # blank: a record skipped, not a row
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _csv_input(folder, ids=None):
    """CSV in two files: `_prompt`'s rows (the null prompt an empty cell), a record of
    too many fields, a prompt quoting a newline."""
    ids = ids or [f"k{i}" for i in range(NUM_ROWS)]
    folder.mkdir()
    for name, rows in (("a.csv", range(0, 11)), ("b.csv", range(11, NUM_ROWS))):
        with open(folder / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["key", "prompt", "lang"])
            for i in rows:
                prompt = _prompt(i) or ""
                if i == 4:
                    prompt += "\nsecond line"
                extra = ["surplus"] if i == BAD_LINE else []
                writer.writerow([ids[i], prompt, f"l{i}", *extra])
    return str(folder)


def _parquet_input(path, ids=None):
    """Parquet in row groups of 4: `_prompt`'s rows, the null prompt a null."""
    ids = ids or [f"k{i}" for i in range(NUM_ROWS)]
    table = pa.table(
        {
            "key": ids,
            "prompt": [_prompt(i) for i in range(NUM_ROWS)],
            "lang": [f"l{i}" for i in range(NUM_ROWS)],
        }
    )
    pq.write_table(table, path, row_group_size=4)
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


def _spread(spec, fan_out, **options):
    # JSON Lines ranges of a few lines: a tiny input split as a large one is
    return plan_job_spread(spec, fan_out=fan_out, min_range_bytes=1, **options)


def _local_then_spread(tmp_path, model, fan_out, src=None, **options):
    """(local plan, its plan files, spread plan, its plan files), both into one output
    (a job's id names where it writes)."""
    src = src or _input(tmp_path / "in.jsonl")
    output = tmp_path / "out"
    local = plan_job(_spec(src, output, model, **options), min_shards=2)
    local_files = _plan_files(output)
    shutil.rmtree(output, ignore_errors=True)  # an empty job writes nothing
    spread = _spread(_spec(src, output, model, **options), fan_out, min_shards=2)
    return local, local_files, spread, _plan_files(output)


def test_spread_plan_is_the_local_plan(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out
    )
    # two byte ranges counted, read, two id buckets checked; the 5 windows cut in 4 runs
    # (copies of sources another run cut among them), then placed in the run order
    assert fan_out.parts_run == [
        ("count_partitions", 2),
        ("read_part", 2),
        ("check_bucket", 2),
        *CUT_ROUNDS,
    ]
    assert spread.shards == local.shards and spread.job_id == local.job_id
    # 21 good rows on 7 distinct prompts: 14 copies
    assert (spread.num_rows, spread.num_failed, spread.rows_deduplicated) == (NUM_ROWS, 2, 14)
    assert (local.num_rows, local.num_failed, local.rows_deduplicated) == (NUM_ROWS, 2, 14)
    assert (spread.rows_read, spread.rows_skipped_blank) == (local.rows_read, 1)
    assert local.rows_skipped_blank == 1
    assert len({s.window for s in spread.shards}) == 5  # 23 rows in windows of 5
    assert any(s.is_copy for s in spread.shards)
    # every plan file byte for byte: rows, order, token ids, errors, passthrough, sources
    assert spread_files == local_files and len(spread_files) == len(spread.shards)
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()  # staging is gone


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_csv_and_parquet_spread_plans_are_the_local_plans(
    tmp_path, tiny_model_dir, two_workers, fmt
):
    if fmt == "csv":
        src, rounds = _csv_input(tmp_path / "in"), [("count_partitions", 2)]
    else:  # row groups: counted by the footer, no counting round
        src, rounds = _parquet_input(tmp_path / "in.parquet"), []
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out, src=src
    )
    assert fan_out.parts_run == [*rounds, ("read_part", 2), ("check_bucket", 2), *CUT_ROUNDS]
    assert spread.shards == local.shards and spread.job_id == local.job_id
    failed = 2 if fmt == "csv" else 1  # CSV's record of too many fields
    assert (local.num_rows, local.num_failed) == (NUM_ROWS, failed)
    assert (spread.num_rows, spread.num_failed) == (NUM_ROWS, failed)
    assert spread.rows_deduplicated == local.rows_deduplicated > 0
    assert (spread.rows_read, spread.rows_skipped_blank) == (local.rows_read, 0)
    assert spread_files == local_files and len(spread_files) == len(spread.shards)


def test_a_job_it_cannot_spread_is_planned_here_the_same(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out, json_schema_column="lang"
    )
    assert fan_out.parts_run == []  # per-row params: no part ran


def test_a_limit_is_planned_here_the_same(tmp_path, tiny_model_dir, two_workers):
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out, limit=14
    )
    assert fan_out.parts_run == []  # the first rows in order: read here
    assert spread.num_rows == 14 and spread.shards == local.shards
    assert spread_files == local_files
    assert spread.shards == local.shards and spread_files == local_files


@pytest.mark.parametrize(
    ("write", "name"), [(_input, "in.jsonl"), (_csv_input, "in"), (_parquet_input, "in.parquet")]
)
def test_duplicate_ids_fail_with_the_local_message(
    tmp_path, tiny_model_dir, two_workers, write, name
):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[17] = ids[3] = "twice"
    ids[21] = "k2"
    src = write(tmp_path / name, ids=ids)
    with pytest.raises(ValueError) as local:
        plan_job(_spec(src, tmp_path / "local", str(tiny_model_dir)))
    assert "2 duplicate id(s) in column 'key': 'twice', 'k2'" in str(local.value)
    with pytest.raises(ValueError) as spread:
        _spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), CountingFanOut())
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
    plan = _spread(spec, CountingFanOut())
    prepare_output(plan)
    for shard in plan.shards[:3]:
        run_shard(fake_llm, plan, shard)
    again = _spread(spec, CountingFanOut())
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
    # its line in the file (a blank line before it), though its range starts mid-file
    assert f"line {BAD_LINE + 2}: invalid JSON" in errors[f"row-{BAD_LINE:09d}"]
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


def test_a_job_without_copies_is_cut_as_its_parts_stage(tmp_path, tiny_model_dir, two_workers):
    # 4 parts a worker, answered in order; the plan still the local one
    fan_out = CountingFanOut()
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), fan_out, dedupe=False
    )
    assert fan_out.parts_run == [("count_partitions", 2), ("read_part", 8), ("check_bucket", 2)]
    assert spread.shards == local.shards and spread.job_id == local.job_id
    assert (spread.num_rows, spread.num_failed, spread.rows_deduplicated) == (NUM_ROWS, 2, 0)
    assert (spread.rows_read, spread.rows_skipped_blank) == (local.rows_read, 1)
    assert spread_files == local_files and len(spread_files) == len(spread.shards)
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()
    # and from a task on a one-thread worker, as the flow's plan task
    shutil.rmtree(tmp_path / "out")
    spec = _spec(_input(tmp_path / "in.jsonl"), tmp_path / "out", str(tiny_model_dir), dedupe=False)
    shards = two_workers.submit(_plan_on_a_worker, spec, pure=False).result(timeout=120)
    assert shards == local.shards


def test_a_failing_part_fails_the_streamed_cut(tmp_path, tiny_model_dir, two_workers):
    src = _input(tmp_path / "in.jsonl")

    class GrowingInput(CountingFanOut):
        def imap(self, fn, args):  # a line lands after the driver opened the input
            with open(src, "a") as f:
                f.write(json.dumps({"key": "late", "prompt": "late", "lang": "l"}) + "\n")
            return super().imap(fn, args)

    with pytest.raises(RuntimeError, match=r"the input changed while it was planned \(.*size"):
        _spread(_spec(src, tmp_path / "out", str(tiny_model_dir), dedupe=False), GrowingInput())
    assert not list((tmp_path / "out" / "_plan").glob("*"))
    # a part still running when the first answer failed may stage after the removal:
    # the next planning removes what it left before it reads
    spec = _spec(src, tmp_path / "out", str(tiny_model_dir), dedupe=False)
    plan = _spread(spec, CountingFanOut())
    assert plan.num_rows == NUM_ROWS + 1
    assert _plan_files(tmp_path / "out").keys() == {s.shard_id for s in plan.shards}
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()


def test_null_ids_fail_with_the_local_message(tmp_path, tiny_model_dir, two_workers):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[6] = ids[19] = None  # one in each byte range
    src = _input(tmp_path / "in.jsonl", ids=ids)
    with pytest.raises(ValueError) as local:
        plan_job(_spec(src, tmp_path / "local", str(tiny_model_dir)))
    assert "is null in 2 row(s) (first at row 6)" in str(local.value)
    fan_out = CountingFanOut()
    with pytest.raises(ValueError) as spread:
        _spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), fan_out)
    assert str(spread.value) == str(local.value)
    assert ("check_bucket", 2) not in fan_out.parts_run  # nulls fail first


def test_an_input_changed_under_the_parts_fails(tmp_path, tiny_model_dir, two_workers):
    src = _input(tmp_path / "in.jsonl")

    class GrowingInput(CountingFanOut):
        def map(self, fn, args):  # a line lands after the driver opened the input
            with open(src, "a") as f:
                f.write(json.dumps({"key": "late", "prompt": "late", "lang": "l"}) + "\n")
            return super().map(fn, args)

    with pytest.raises(RuntimeError, match=r"the input changed while it was planned \(.*size"):
        _spread(_spec(src, tmp_path / "out", str(tiny_model_dir)), GrowingInput())
    assert not (tmp_path / "out" / "_plan").exists()
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()


def test_an_input_of_blank_lines_is_an_empty_job_as_here(tmp_path, tiny_model_dir, two_workers):
    src = tmp_path / "in.jsonl"
    src.write_text("\n  \n\n")
    local, local_files, spread, spread_files = _local_then_spread(
        tmp_path, str(tiny_model_dir), CountingFanOut(), src=str(src)
    )
    assert (spread.num_rows, spread.rows_skipped_blank, spread.shards) == (0, 3, [])
    assert (local.num_rows, local.rows_skipped_blank) == (0, 3)
    assert spread.empty_warning == local.empty_warning is not None


def test_a_deduping_plan_cut_by_the_workers_on_an_object_store(
    tmp_path, tiny_model_dir, two_workers, s3
):
    # The workers stage each window's shards, then place them under their ids in the
    # run order: on S3 a copy within the store. The plan files are the local planner's.
    fs = s3fs.S3FileSystem(**s3.storage_options)
    src = _input(tmp_path / "in.jsonl")
    local_out, spread_out = s3.url(f"{uuid.uuid4().hex}/out"), s3.url(f"{uuid.uuid4().hex}/out")
    spec = _spec(src, local_out, str(tiny_model_dir), storage_options=s3.storage_options)
    local = plan_job(spec, min_shards=2)
    fan_out = CountingFanOut()
    spread = _spread(replace(spec, output=spread_out), fan_out, min_shards=2)
    assert fan_out.parts_run[-2:] == CUT_ROUNDS
    assert spread.shards == local.shards and spread.rows_deduplicated == 14

    def plan_files(output):
        folder = out.plan_uri(output)
        return {p.rsplit("/", 1)[1]: fs.cat(p) for p in fs.ls(folder, refresh=True)}

    assert plan_files(spread_out) == plan_files(local_out)
    assert len(plan_files(spread_out)) == len(spread.shards)
    assert not fs.exists(out.join(spread_out, out.WINDOWS_DIR))  # staging is gone
