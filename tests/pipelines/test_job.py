"""run_job / plan_job / run_shard / finalize_job with a scripted LLM (no model compute)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import SourceError
from tokenmill.pipelines import planning
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.job import (
    finalize_job,
    load_shard,
    plan_job,
    prepare_output,
    run_job,
    run_shard,
)
from tokenmill.pipelines.output import (
    completed_shards,
    read_ledger,
    read_ledger_dataset,
    read_results,
    read_shard_stats,
)
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_rows

PROMPTS = [
    "Shared preamble. Question one?",
    None,
    "Shared preamble. Question two, longer than one?",
    "",
    "A lone prompt",
    "x" * 5000,  # longer than the fake model's context
    "Shared preamble. Q3",
]


def _write_input(path, prompts=PROMPTS, **extra):
    table = pa.table({"prompt": pa.array(prompts, pa.string()), **extra})
    pq.write_table(table, path)
    return str(path)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load or even resolve the model."""

    def refuse(*a, **k):
        raise AssertionError("the model must not be touched")

    monkeypatch.setattr(llm_cache, "get_llm", refuse)
    monkeypatch.setattr(planning, "describe_model", refuse)


def test_every_row_answered_once_and_ledger_matches_rows(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    out = str(tmp_path / "out")
    ledger = run_job(src, out, llm=fake_llm, max_tokens=8, shard_tokens=60)
    results = read_results(out)
    assert sorted(results["id"].to_pylist()) == [f"row-{i:09d}" for i in range(7)]
    by_id = {r["id"]: r for r in results.to_pylist()}
    assert by_id["row-000000001"]["error"] == "prompt is null"
    assert by_id["row-000000003"]["error"] == "prompt is empty"
    # sent as a user message: "<user>" + 5000 characters + "</><assistant>"
    assert by_id["row-000000005"]["error"].startswith("prompt is 5020 tokens, longer than")
    for i in (0, 2, 4, 6):
        row = by_id[f"row-{i:09d}"]
        assert row["error"] is None and row["finish_reason"] == "stop"
        assert row["output"] == f"len={row['prompt_tokens']}"
    assert (ledger.rows_ok, ledger.rows_failed) == (4, 3)
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        assert getattr(ledger, name) == sum(results[name].to_pylist())
    assert ledger.cached_tokens > 0  # the shared preamble was reused
    assert ledger.num_shards > 1 and ledger.num_shards_run == ledger.num_shards
    on_disk = json.loads((tmp_path / "out" / "ledger.json").read_text())
    assert on_disk["job_id"] == ledger.job_id and on_disk["cost_total"] == ledger.cost_total
    assert read_ledger_dataset(str(tmp_path / "out" / "ledger")).num_rows == 1


def test_rerun_skips_complete_shards(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    out = str(tmp_path / "out")
    spec = JobSpec(src, out, shard_tokens=60)
    plan = plan_job(spec, llm=fake_llm)
    prepare_output(plan)
    first = run_shard(fake_llm, plan, plan.shards[0])
    assert not first.skipped
    with pytest.raises(RuntimeError, match="incomplete"):
        finalize_job(plan)
    part = tmp_path / "out" / "results" / f"{plan.shards[0].shard_id}.parquet"
    mtime = os.stat(part).st_mtime_ns
    calls_before = len(fake_llm.calls)
    # shards with a row to generate: each is one generate() call
    to_generate = sum(
        1 for s in plan.shards[1:] if any(r.token_ids for r in shard_rows(load_shard(plan, s)).rows)
    )
    ledger = run_job(src, out, llm=fake_llm, shard_tokens=60)
    assert os.stat(part).st_mtime_ns == mtime  # not rewritten
    assert ledger.num_shards_run == len(plan.shards) - 1
    assert len(fake_llm.calls) - calls_before == to_generate > 0
    results = read_results(out)
    assert results.num_rows == 7 and len(set(results["id"].to_pylist())) == 7
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())
    # running a shard again is a no-op
    assert run_shard(fake_llm, plan, plan.shards[0]).skipped
    again = run_job(src, out, llm=fake_llm, shard_tokens=60)
    assert again.num_shards_run == 0 and again.job_id == ledger.job_id
    assert again.prompt_tokens == ledger.prompt_tokens
    assert read_ledger_dataset(str(tmp_path / "out" / "ledger")).num_rows == 1


def test_changed_job_refuses_foreign_parts_and_no_resume_replaces(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    out = str(tmp_path / "out")
    run_job(src, out, llm=fake_llm, max_tokens=8)
    with pytest.raises(ValueError, match="not shards of this job"):
        run_job(src, out, llm=fake_llm, max_tokens=9)
    ledger = run_job(src, out, llm=fake_llm, max_tokens=9, resume=False)
    assert ledger.rows_ok + ledger.rows_failed == 7
    assert read_results(out).num_rows == 7


def test_template_passthrough_id_column_and_jsonl_parts(tmp_path, fake_llm):
    src = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {"key": ["a", "b", "c"], "text": ["one", None, "three"], "lang": ["en", "fr", "de"]}
        ),
        src,
    )
    out = tmp_path / "out"
    ledger = run_job(
        str(src),
        str(out),
        llm=fake_llm,
        template="Summarise: {text}",
        id_column="key",
        passthrough=["lang"],
        output_format="jsonl",
    )
    assert sorted(p.name.rsplit(".", 1)[1] for p in (out / "results").iterdir()) == ["jsonl"]
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    # the filled template goes through the chat template as a user message
    wrapped = "<user>Summarise: one</><assistant>"
    assert rows["a"]["lang"] == "en" and rows["a"]["prompt_tokens"] == len(wrapped)
    assert rows["b"]["error"] == "template column 'text' is null" and rows["b"]["lang"] == "fr"
    assert ledger.rows_ok == 2


def test_limit(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    ledger = run_job(src, str(tmp_path / "out"), llm=fake_llm, limit=3)
    assert ledger.rows_ok + ledger.rows_failed == 3


def test_engine_errors_become_error_rows(tmp_path, tiny_model_dir):
    from pipeline_fakes import FakeLLM

    llm = FakeLLM(model_dir=tiny_model_dir, fail_on=ord("!"))
    src = _write_input(tmp_path / "in.parquet", ["fine", "boom!", "also fine"])
    run_job(src, str(tmp_path / "out"), llm=llm)
    errors = {r["id"]: r["error"] for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert errors == {
        "row-000000000": None,
        "row-000000001": "engine refused",
        "row-000000002": None,
    }


# -- bad input fails before any compute --------------------------------------------------


def test_missing_column_fails_before_compute(tmp_path, no_model_load):
    src = _write_input(tmp_path / "data.parquet")
    with pytest.raises(SourceError, match=r"data\.parquet: column\(s\) 'question' not found"):
        run_job(src, str(tmp_path / "out"), prompt_column="question")
    assert not (tmp_path / "out").exists()


def test_missing_template_column_fails_before_compute(tmp_path, no_model_load):
    src = _write_input(tmp_path / "data.parquet")
    with pytest.raises(SourceError, match="'text' not found"):
        run_job(src, str(tmp_path / "out"), template="Summarise: {text}")


def test_corrupt_file_fails_before_compute(tmp_path, no_model_load):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(SourceError, match=r"broken\.parquet: not a readable parquet file"):
        run_job(str(bad), str(tmp_path / "out"))


def test_missing_file_and_bad_url_fail_before_compute(tmp_path, no_model_load):
    with pytest.raises(SourceError, match="nope.parquet"):
        run_job(str(tmp_path / "nope.parquet"), str(tmp_path / "out"))
    with pytest.raises(SourceError, match="nosuchproto://bucket/x.parquet"):
        run_job("nosuchproto://bucket/x.parquet", str(tmp_path / "out"))


def test_duplicate_ids_fail_before_compute(tmp_path, fake_llm):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1, 2, 1, 3, 2], "prompt": ["a", "b", "c", "d", "e"]}), src)
    with pytest.raises(ValueError, match=r"2 duplicate id\(s\) in column 'id': '1', '2'"):
        run_job(str(src), str(tmp_path / "out"), llm=fake_llm, id_column="id")
    assert fake_llm.calls == []


def test_null_ids_fail_before_compute(tmp_path, fake_llm):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", None], "prompt": ["a", "b"]}), src)
    with pytest.raises(
        ValueError, match=r"id column 'id' is null in 1 row\(s\) \(first at row 1\)"
    ):
        run_job(str(src), str(tmp_path / "out"), llm=fake_llm, id_column="id")
    assert fake_llm.calls == []


def test_bad_options_fail_fast(tmp_path):
    with pytest.raises(ValueError, match="output_format"):
        JobSpec("in", "out", output_format="xml")
    with pytest.raises(ValueError, match="clash"):
        JobSpec("in", "out", passthrough=["output"])
    with pytest.raises(TypeError, match="give the sampling options themselves"):
        run_job("in", "out", max_tokens=3, sampling=None)
    with pytest.raises(TypeError, match="unknown option 'max_token'; did you mean 'max_tokens'"):
        run_job("in", "out", max_token=3)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        run_job("in", "out", temperature=-1)


def test_spec_hides_credentials_in_repr():
    spec = JobSpec("s3://b/in.parquet", "s3://b/out", storage_options={"secret": "hunter2"})
    assert "hunter2" not in repr(spec)


# -- OpenAI batch in, OpenAI batch out ---------------------------------------------------


def test_openai_batch_roundtrip(tmp_path, fake_llm):
    lines = [
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
            },
        },
        {
            "custom_id": "cmpl-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "x", "prompt": "Once upon", "temperature": 0.5},
        },
        {
            "custom_id": "bad-temp",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "x", "prompt": "x", "temperature": -3},
        },
        {
            "custom_id": "bad-n",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "x", "prompt": "x", "n": 0},
        },
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n")
    out = tmp_path / "out"
    ledger = run_job(
        str(src), str(out), llm=fake_llm, format="openai-batch", output_format="openai-batch"
    )
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert rows["chat-1"]["completion_tokens"] == 2  # the row's max_tokens
    assert rows["chat-1"]["finish_reason"] == "length"
    assert rows["cmpl-1"]["completion_tokens"] == 3
    assert rows["bad-temp"]["error"].startswith("invalid sampling parameters: temperature")
    assert rows["bad-n"]["error"] == "invalid sampling parameters: n must be >= 1, got 0"
    assert "line 5" in rows["row-000000004"]["error"]
    assert (ledger.rows_ok, ledger.rows_failed) == (2, 3)
    written = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [w["custom_id"] for w in written] == [
        "chat-1",
        "cmpl-1",
        "bad-temp",
        "bad-n",
        "row-000000004",
    ]
    chat = written[0]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 2
    assert written[1]["response"]["body"]["object"] == "text_completion"
    assert written[2]["error"]["message"].startswith("invalid sampling parameters")


def test_ledger_file_round_trips(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    ledger = run_job(src, str(tmp_path / "out"), llm=fake_llm, price_input=1.0, price_output=2.0)
    assert read_ledger(str(tmp_path / "out")) == ledger
    assert ledger.cost_total == pytest.approx(
        (ledger.prompt_tokens - ledger.cached_tokens) * 1e-6
        + ledger.cached_tokens * 1e-6
        + ledger.completion_tokens * 2e-6
    )


def test_empty_input_gives_an_empty_job(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet", [])
    ledger = run_job(src, str(tmp_path / "out"), llm=fake_llm)
    assert (ledger.rows_ok, ledger.rows_failed, ledger.num_shards, ledger.cost_total) == (
        0,
        0,
        0,
        0.0,
    )
    assert fake_llm.calls == []


def test_plan_and_results_pickle_for_task_runners(tmp_path, fake_llm):
    import pickle

    src = _write_input(tmp_path / "in.parquet")
    spec = JobSpec(src, str(tmp_path / "out"), shard_tokens=60, passthrough=("prompt",))
    plan = pickle.loads(pickle.dumps(plan_job(spec, llm=fake_llm)))
    prepare_output(plan)
    results = [pickle.loads(pickle.dumps(run_shard(fake_llm, plan, s))) for s in plan.shards]
    ledger = pickle.loads(pickle.dumps(finalize_job(plan, num_shards_run=len(results))))
    assert sum(r.num_rows for r in results) == ledger.rows_ok + ledger.rows_failed == 7
    assert sum(r.rows_failed for r in results) == ledger.rows_failed
    assert read_results(spec.output)["prompt"].to_pylist().count(None) == 1


def test_openai_duplicate_custom_ids_fail_before_compute(tmp_path, fake_llm):
    line = {
        "custom_id": "same",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "x", "prompt": "hi"},
    }
    src = tmp_path / "batch.jsonl"
    src.write_text((json.dumps(line) + "\n") * 2)
    with pytest.raises(ValueError, match="duplicate id"):
        run_job(str(src), str(tmp_path / "out"), llm=fake_llm, format="openai-batch")
    assert fake_llm.calls == []


def test_shard_published_concurrently_is_kept(tmp_path, fake_llm, monkeypatch):
    src = _write_input(tmp_path / "in.parquet")
    spec = JobSpec(src, str(tmp_path / "out"), resume=False)
    plan = plan_job(spec, llm=fake_llm)
    prepare_output(plan)
    assert not run_shard(fake_llm, plan, plan.shards[0]).skipped
    # with resume off run_shard does not look first; the atomic no-clobber write refuses
    assert run_shard(fake_llm, plan, plan.shards[0]).skipped
    assert read_results(spec.output).num_rows == 7


def test_non_string_prompt_column_gives_row_errors(tmp_path, fake_llm):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [[1, 2], None, [3]], "n": [7, 8, 9]}), src)
    ledger = run_job(str(src), str(tmp_path / "out"), llm=fake_llm)
    errors = read_results(str(tmp_path / "out"))["error"].to_pylist()
    assert sorted(errors) == ["prompt is not a string (got list)"] * 2 + ["prompt is null"]
    assert ledger.rows_failed == 3 and fake_llm.calls == []
    # numbers are fine inside a template
    ledger = run_job(str(src), str(tmp_path / "out2"), llm=fake_llm, template="Count to {n}")
    assert ledger.rows_ok == 3


def test_shard_stats_carry_the_parts_row_and_token_counts(tmp_path, fake_llm):
    """Progress read from the stats alone (the Batch API's Prefect runner does) counts
    error rows as failed, not completed, and the tokens the ledger will bill."""
    src = _write_input(tmp_path / "in.parquet")
    out = str(tmp_path / "out")
    ledger = run_job(src, out, llm=fake_llm, max_tokens=8, shard_tokens=60)
    stats = read_shard_stats(out, sorted(completed_shards(out)))
    assert len(stats) > 1 and ledger.rows_failed > 0
    assert sum(s.rows_failed for s in stats) == ledger.rows_failed
    assert sum(s.num_rows - s.rows_failed for s in stats) == ledger.rows_ok
    assert sum(s.prompt_tokens for s in stats) == ledger.prompt_tokens
    assert sum(s.cached_tokens for s in stats) == ledger.cached_tokens
    assert sum(s.completion_tokens for s in stats) == ledger.completion_tokens > 0


def test_non_string_prompts_mixed_into_jsonl_give_row_errors(tmp_path, fake_llm):
    # JSONL can mix types in one column; a number or list among text prompts is an
    # error row under its own id, not the prompt "42".
    src = tmp_path / "in.jsonl"
    rows = [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": 42}, {"id": "c", "prompt": [1]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"id": "d", "prompt": "yo"}]))
    ledger = run_job(str(src), str(tmp_path / "out"), llm=fake_llm, id_column="id")
    results = read_results(str(tmp_path / "out")).sort_by("id").to_pydict()
    assert results["id"] == ["a", "b", "c", "d"]
    assert results["finish_reason"] == ["stop", "error", "error", "stop"]
    assert "line 2: column 'prompt': a int value where text was expected" in results["error"][1]
    assert "a list value where text was expected" in results["error"][2]
    assert ledger.rows_ok == 2 and ledger.rows_failed == 2


def test_a_resume_keeps_the_cut_of_the_first_run(tmp_path, fake_llm):
    """A job first cut for two workers, resumed by a run asking for one, plans the same
    shards (the cut is recorded in OUTPUT/_cut.json)."""
    src = _write_input(tmp_path / "in.parquet", [f"Question {i}?" for i in range(12)])
    out = str(tmp_path / "out")
    spec = JobSpec(src, out, max_tokens=4)
    assert len(plan_job(spec, llm=fake_llm).shards) == 1
    plan = plan_job(spec, llm=fake_llm, min_shards=2)
    assert len(plan.shards) == 2 and plan.min_shards == 2
    prepare_output(plan)
    run_shard(fake_llm, plan, plan.shards[0])
    again = plan_job(spec, llm=fake_llm, min_shards=1)  # e.g. `tokenmill run` resuming it
    assert [s.shard_id for s in again.shards] == [s.shard_id for s in plan.shards]
    ledger = run_job(src, out, llm=fake_llm, max_tokens=4)
    assert ledger.num_shards == 2 and ledger.num_shards_run == 1


def test_a_resume_keeps_the_cut_rule_its_parts_were_cut_with(tmp_path, fake_llm):
    """A fresh job for several workers is cut by the balance rule, for one by the prefix
    rule; a resume plans with the rule its results were cut with: the balance or the
    prefix rule as recorded, and filling for results recorded before cuts had rules."""
    src = _write_input(tmp_path / "in.parquet", [f"Question {i}?" for i in range(12)])
    out = str(tmp_path / "out")
    spec = JobSpec(src, out, max_tokens=4)
    assert planning._cut(spec, 2) == (2, "balance")  # nothing to resume
    assert planning._cut(spec, 1) == (1, "prefix")
    plan = plan_job(spec, llm=fake_llm, min_shards=2)
    assert plan.cut_rule == "balance"
    prepare_output(plan)
    run_shard(fake_llm, plan, plan.shards[0])
    cut_file = tmp_path / "out" / "_cut.json"
    assert json.loads(cut_file.read_text()) == {"min_shards": 2, "rule": "balance"}
    assert planning._cut(spec, 1) == (2, "balance")
    again = plan_job(spec, llm=fake_llm, min_shards=3)
    assert [s.shard_id for s in again.shards] == [s.shard_id for s in plan.shards]
    cut_file.write_text(json.dumps({"min_shards": 2, "rule": "prefix"}))  # an older run's
    assert planning._cut(spec, 2) == (2, "prefix")
    assert plan_job(spec, llm=fake_llm, min_shards=2).cut_rule == "prefix"
    cut_file.write_text(json.dumps({"min_shards": 2}))  # as recorded before rules
    assert planning._cut(spec, 1) == (2, "fill")
    assert plan_job(spec, llm=fake_llm).cut_rule == "fill"
    cut_file.unlink()  # parts from before the cut was recorded at all
    assert planning._cut(spec, 3) == (3, "fill")
    assert planning._cut(JobSpec(src, out, max_tokens=4, resume=False), 3) == (3, "balance")


def test_the_ledger_names_the_jobs_own_quantization_and_none_for_float_weights(tmp_path, fake_llm):
    src = _write_input(tmp_path / "in.parquet")
    assert run_job(src, str(tmp_path / "float"), llm=fake_llm).quantization is None
    ledger = run_job(src, str(tmp_path / "int4"), llm=fake_llm, quantization="int4")
    assert ledger.quantization == "int4"
