"""A spread plan whose rows cannot be copies (no dedupe, or sampled answers) is cut while
its reading parts still stage: the driver plans a part's windows as soon as it and the
parts before it are in, and the plan is still the local planner's, file for file. Ids
are checked once the last part is in; a null or repeated id fails with the local
message and leaves no plan file. Parts run in this process, one at a time, so the order
of events is exact; `test_spread_planning.py` runs the same planning on Dask workers."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenmill.pipelines import output as out
from tokenmill.pipelines import spread_planning
from tokenmill.pipelines.job import plan_job
from tokenmill.pipelines.spec import JobSpec

NUM_ROWS = 40
WINDOW = 5


class InOrderFanOut:
    """Runs each call when its answer is asked for, recording the plan files the driver
    had written by then: what it cut while later parts had not run."""

    num_parts = 2

    def __init__(self, output):
        self.output = output
        self.plan_files_before_part: list[int] = []

    def map(self, fn, args):
        return [fn(*a) for a in args]

    def imap(self, fn, args):
        for a in args:
            self.plan_files_before_part.append(len(list((self.output / "_plan").glob("*"))))
            yield fn(*a)


def _input(path, ids):
    path.write_text(
        "".join(
            json.dumps({"key": rid, "prompt": f"question {i % 9} on topic {i % 4}"}) + "\n"
            for i, rid in enumerate(ids)
        )
    )
    return str(path)


def _spec(src, output, model, **options):
    args = dict(
        model=model,
        id_column="key",
        shard_tokens=40,
        plan_window_rows=WINDOW,
        max_tokens=4,
        dedupe=False,
    )
    return JobSpec(src, str(output), **{**args, **options})


def _plan_files(output):
    return {p.stem: p.read_bytes() for p in (output / "_plan").glob("*.parquet")}


@pytest.mark.parametrize(
    "options", [{"dedupe": False}, {"dedupe": True, "temperature": 0.7}], ids=["off", "sampled"]
)
def test_the_cut_starts_while_parts_stage_and_plans_the_local_plan(
    tmp_path, tiny_model_dir, options
):
    src = _input(tmp_path / "in.jsonl", [f"k{i}" for i in range(NUM_ROWS)])
    output = tmp_path / "out"
    local = plan_job(_spec(src, output, str(tiny_model_dir), **options), min_shards=2)
    local_files = _plan_files(output)
    shutil.rmtree(output)
    fan_out = InOrderFanOut(output)
    spread = spread_planning.plan_job_spread(
        _spec(src, output, str(tiny_model_dir), **options),
        fan_out=fan_out,
        min_shards=2,
        min_range_bytes=1,
    )
    # 2 workers x 4 parts each; before the first part, nothing cut; before the last,
    # the windows of the parts before it are cut already
    assert len(fan_out.plan_files_before_part) == 8
    assert fan_out.plan_files_before_part[0] == 0
    assert fan_out.plan_files_before_part[-1] > 0
    assert fan_out.plan_files_before_part == sorted(fan_out.plan_files_before_part)
    assert spread.shards == local.shards and spread.job_id == local.job_id
    assert (spread.num_rows, spread.rows_deduplicated) == (NUM_ROWS, 0)
    assert len({s.window for s in spread.shards}) == NUM_ROWS // WINDOW
    assert _plan_files(output) == local_files and len(local_files) == len(spread.shards)
    assert not (output / out.WINDOWS_DIR).exists()


def test_a_job_that_may_copy_rows_cuts_after_every_part(tmp_path, tiny_model_dir):
    src = _input(tmp_path / "in.jsonl", [f"k{i}" for i in range(NUM_ROWS)])
    fan_out = InOrderFanOut(tmp_path / "out")
    plan = spread_planning.plan_job_spread(
        _spec(src, tmp_path / "out", str(tiny_model_dir), dedupe=True),
        fan_out=fan_out,
        min_range_bytes=1,
    )
    assert fan_out.plan_files_before_part == []  # its parts ran by map, one per worker
    assert plan.rows_deduplicated == NUM_ROWS - 36  # 36 distinct prompts (9 x 4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({3: "twice", 37: "twice", 30: "k2"}, "2 duplicate id(s) in column 'key': 'k2', 'twice'"),
        ({6: None, 33: None}, "is null in 2 row(s) (first at row 6)"),
    ],
    ids=["repeated", "null"],
)
def test_bad_ids_fail_after_the_cut_with_the_local_message(
    tmp_path, tiny_model_dir, changes, message
):
    ids = [changes.get(i, f"k{i}") for i in range(NUM_ROWS)]
    src = _input(tmp_path / "in.jsonl", ids)
    with pytest.raises(ValueError) as local:
        plan_job(_spec(src, tmp_path / "local", str(tiny_model_dir)))
    assert message in str(local.value)
    fan_out = InOrderFanOut(tmp_path / "out")
    with pytest.raises(ValueError) as spread:
        spread_planning.plan_job_spread(
            _spec(src, tmp_path / "out", str(tiny_model_dir)), fan_out=fan_out, min_range_bytes=1
        )
    assert str(spread.value) == str(local.value)
    assert fan_out.plan_files_before_part[-1] > 0  # windows were cut, then removed
    assert not list((tmp_path / "out" / "_plan").glob("*"))
    assert not (tmp_path / "out" / out.WINDOWS_DIR).exists()
