"""Planning in windows: shards per window, plan files under OUTPUT/_plan/, ids checked
over the whole input - with a scripted LLM, so no model compute."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.pipelines.job import (
    finalize_job,
    load_shard,
    plan_job,
    prepare_output,
    run_job,
    run_shard,
)
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_rows

NUM_ROWS = 23
WINDOW = 5


def _prompts(n=NUM_ROWS):
    # three shared prefixes, so rows of one window group together; one null prompt
    heads = ["System: be brief. ", "Translate: ", ""]
    return [None if i == 9 else heads[i % 3] + "word " * (1 + i % 4) + str(i) for i in range(n)]


def _input(path, ids=None, n=NUM_ROWS):
    ids = ids or [f"k{i}" for i in range(n)]
    table = pa.table({"key": ids, "prompt": _prompts(n), "lang": [f"l{i}" for i in range(n)]})
    pq.write_table(table, path)
    return str(path)


def _spec(src, output, **options):
    """The JobSpec `run_job(**_job_args(src, output, **options))` runs."""
    args = _job_args(src, output, **options)
    return JobSpec(args.pop("input"), args.pop("output"), **args)


def test_every_row_in_one_shard_and_no_shard_spans_windows(tmp_path, fake_llm):
    plan = plan_job(_spec(_input(tmp_path / "in.parquet"), tmp_path / "out"), llm=fake_llm)
    seen = []
    for shard in plan.shards:
        planned = shard_rows(load_shard(plan, shard))
        indices = [r.row_index for r in planned.rows]
        window = range(shard.window * WINDOW, (shard.window + 1) * WINDOW)
        assert all(i in window for i in indices), (shard, indices)
        # what the plan file holds is what the input said, row by row
        assert [r.id for r in planned.rows] == [f"k{i}" for i in indices]
        assert planned.passthrough["lang"].to_pylist() == [f"l{i}" for i in indices]
        seen += indices
    assert sorted(seen) == list(range(NUM_ROWS))
    assert sorted({s.window for s in plan.shards}) == list(range(5))  # 23 rows / 5
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    assert (plan.num_rows, plan.num_failed) == (NUM_ROWS, 1)
    on_disk = {p.stem for p in (tmp_path / "out" / "_plan").glob("*.parquet")}
    assert on_disk == {s.shard_id for s in plan.shards}


def test_planning_twice_gives_the_same_shards_and_job(tmp_path, fake_llm):
    src = _input(tmp_path / "in.parquet")
    first = plan_job(_spec(src, tmp_path / "out"), llm=fake_llm)
    again = plan_job(_spec(src, tmp_path / "out"), llm=fake_llm)
    assert again.shards == first.shards and again.job_id == first.job_id
    # the window size is part of what is computed: other windows, other shards
    wider = plan_job(_spec(src, tmp_path / "out", plan_window_rows=50), llm=fake_llm)
    assert {s.window for s in wider.shards} == {0}
    assert wider.job_id != first.job_id


def test_a_window_of_the_whole_input_plans_as_before(tmp_path, fake_llm):
    # one window: shard ids are the whole input's, so jobs planned before windows resume
    from tokenmill.pipelines.plan import plan_shards
    from tokenmill.pipelines.tokenize import PromptRow

    src = _input(tmp_path / "in.parquet")
    plan = plan_job(_spec(src, tmp_path / "out", plan_window_rows=NUM_ROWS), llm=fake_llm)
    rows: list[PromptRow] = []
    for shard in plan.shards:
        rows += shard_rows(load_shard(plan, shard)).rows
    whole = plan_shards(rows, plan.params, model_key=plan.weights_hash, shard_tokens=60)
    assert [p.shard for p in whole] == plan.shards


def test_windowed_results_equal_one_window_results(tmp_path, fake_llm):
    src = _input(tmp_path / "in.parquet")
    run_job(**_job_args(src, tmp_path / "windows"), llm=fake_llm)
    run_job(**_job_args(src, tmp_path / "whole", plan_window_rows=1000), llm=fake_llm)
    columns = ["id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "lang"]

    def by_id(path):
        return read_results(str(path)).select(columns).sort_by("id").to_pylist()

    assert by_id(tmp_path / "windows") == by_id(tmp_path / "whole")
    assert len(by_id(tmp_path / "windows")) == NUM_ROWS


def _job_args(src, output, **options):
    args = dict(
        input=src,
        output=str(output),
        id_column="key",
        passthrough=("lang",),
        shard_tokens=60,
        plan_window_rows=WINDOW,
        max_tokens=4,
    )
    return {**args, **options}


def test_plan_files_live_until_the_job_finishes(tmp_path, fake_llm):
    spec = _spec(_input(tmp_path / "in.parquet"), tmp_path / "out")
    plan = plan_job(spec, llm=fake_llm)
    plan_dir = tmp_path / "out" / "_plan"
    prepare_output(plan)
    for shard in plan.shards:
        run_shard(fake_llm, plan, shard)
    assert len(list(plan_dir.glob("*.parquet"))) == len(plan.shards)
    ledger = finalize_job(plan, num_shards_run=len(plan.shards))
    assert not plan_dir.exists()
    results = read_results(spec.output)
    assert results.num_rows == NUM_ROWS == ledger.rows_ok + ledger.rows_failed
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        assert getattr(ledger, name) == sum(results[name].to_pylist())
    # a finished job's plan cannot compute a shard again (resume off): it says why
    recompute = dataclasses.replace(plan, spec=dataclasses.replace(spec, resume=False))
    with pytest.raises(RuntimeError, match="has no plan file"):
        run_shard(fake_llm, recompute, plan.shards[0])


def test_duplicate_ids_in_different_windows_fail_before_compute(tmp_path, fake_llm):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[17] = "k2"  # windows 0 and 3
    ids[21] = "k20"  # both in window 4
    src = _input(tmp_path / "in.parquet", ids)
    with pytest.raises(ValueError, match=r"2 duplicate id\(s\) in column 'key': 'k2', 'k20'; "):
        run_job(**_job_args(src, tmp_path / "out"), llm=fake_llm)
    assert fake_llm.calls == []
    assert not (tmp_path / "out" / "_plan").exists()  # every plan file written is gone
    assert not (tmp_path / "out" / "results").exists()


def test_null_ids_in_a_later_window_fail_before_compute(tmp_path, fake_llm):
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[12] = ids[19] = None
    src = _input(tmp_path / "in.parquet", ids)
    with pytest.raises(ValueError, match=r"null in 2 row\(s\) \(first at row 12\)"):
        run_job(**_job_args(src, tmp_path / "out"), llm=fake_llm)
    assert fake_llm.calls == [] and not (tmp_path / "out" / "_plan").exists()


def test_failed_planning_keeps_other_plan_files(tmp_path, fake_llm):
    src = _input(tmp_path / "in.parquet")
    good = plan_job(_spec(src, tmp_path / "out"), llm=fake_llm)
    ids = [f"k{i}" for i in range(NUM_ROWS)]
    ids[22] = "k0"
    bad = _input(tmp_path / "bad.parquet", ids)
    with pytest.raises(ValueError, match="duplicate id"):
        plan_job(_spec(bad, tmp_path / "out", plan_window_rows=7), llm=fake_llm)
    kept = {p.stem for p in (tmp_path / "out" / "_plan").glob("*.parquet")}
    assert kept == {s.shard_id for s in good.shards}


def test_no_resume_removes_stale_plan_files(tmp_path, fake_llm):
    src = _input(tmp_path / "in.parquet")
    stale = plan_job(_spec(src, tmp_path / "out", plan_window_rows=7), llm=fake_llm)
    plan = plan_job(_spec(src, tmp_path / "out", resume=False), llm=fake_llm)
    plan_dir = tmp_path / "out" / "_plan"
    assert {p.stem for p in plan_dir.glob("*.parquet")} >= {s.shard_id for s in stale.shards}
    prepare_output(plan)
    assert {p.stem for p in plan_dir.glob("*.parquet")} == {s.shard_id for s in plan.shards}


def test_resume_after_a_partial_run_with_windows(tmp_path, fake_llm):
    src = _input(tmp_path / "in.parquet")
    plan = plan_job(_spec(src, tmp_path / "out"), llm=fake_llm)
    prepare_output(plan)
    for shard in plan.shards[:3]:
        run_shard(fake_llm, plan, shard)
    ledger = run_job(**_job_args(src, tmp_path / "out"), llm=fake_llm)
    assert ledger.job_id == plan.job_id
    assert ledger.num_shards_run == len(plan.shards) - 3
    ids = read_results(str(tmp_path / "out"))["id"].to_pylist()
    assert sorted(ids) == sorted(f"k{i}" for i in range(NUM_ROWS))


def test_openai_batch_output_in_input_order_across_windows(tmp_path, fake_llm):
    lines = []
    for i in range(11):
        body = {"model": "x", "prompt": ("Same start " if i % 2 else "") + "q" * (11 - i)}
        url = "/v1/completions"
        if i % 3 == 0:
            body = {"model": "x", "messages": [{"role": "user", "content": "hi " * (i + 1)}]}
            url = "/v1/chat/completions"
        lines.append({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out"
    run_job(
        str(src),
        str(output),
        llm=fake_llm,
        format="openai-batch",
        output_format="openai-batch",
        plan_window_rows=4,
        shard_tokens=40,
    )
    written = [json.loads(x) for x in (output / "results.jsonl").read_text().splitlines()]
    assert [w["custom_id"] for w in written] == [f"c{i}" for i in range(11)]
    objects = [w["response"]["body"]["object"] for w in written]
    assert objects == ["chat.completion" if i % 3 == 0 else "text_completion" for i in range(11)]
    assert len({w["response"]["body"]["created"] for w in written}) == 1


def test_plan_window_rows_is_validated():
    with pytest.raises(ValueError, match="plan_window_rows must be >= 1, got 0"):
        JobSpec("in", "out", plan_window_rows=0)
