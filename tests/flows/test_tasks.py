"""Task logic through `task.fn(...)`: no Prefect server, no flow run."""

from __future__ import annotations

import dataclasses
import os

import pytest
from flow_helpers import ENGINE

from tokenmill.connectors import SourceError
from tokenmill.flows.tasks import plan_task, prepare_output_task, shard_task
from tokenmill.pipelines import output as out
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.spec import JobSpec


def make_spec(jsonl_input, output, model):
    return JobSpec(
        jsonl_input,
        str(output),
        model=model,
        id_column="id",
        max_tokens=6,
        shard_tokens=48,
        **ENGINE,
    )


def test_plan_then_shards_are_idempotent(jsonl_input, tmp_path, tiny_model):
    plan = plan_task.fn(make_spec(jsonl_input, tmp_path / "out", tiny_model))
    assert len(plan.shards) > 2
    assert prepare_output_task.fn(plan) == set()
    shard = plan.shards[0]

    first = shard_task.fn(plan, shard, plan.job_id)
    assert not first.result.skipped and first.result.num_rows == shard.num_rows
    assert first.pid == os.getpid() and first.engine_loads >= 1
    assert prepare_output_task.fn(plan) == {shard.shard_id}

    loads = llm_cache.num_loads()
    again = shard_task.fn(plan, shard, plan.job_id)  # a retry or a rerun of the same shard
    assert again.result.skipped
    assert llm_cache.num_loads() == loads  # reused, not reloaded
    assert out.read_results(plan.spec.output).num_rows == shard.num_rows


def test_bad_input_fails_in_planning(tmp_path, tiny_model):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SourceError, match="nope.jsonl"):
        plan_task.fn(make_spec(str(missing), tmp_path / "out", tiny_model))


def test_a_worker_with_other_weights_refuses_the_shard(jsonl_input, tmp_path, tiny_model):
    plan = plan_task.fn(make_spec(jsonl_input, tmp_path / "out", tiny_model))
    forged = dataclasses.replace(plan, weights_hash="0" * 64)
    with pytest.raises(RuntimeError, match="same model files"):
        shard_task.fn(forged, plan.shards[0], plan.job_id)
    assert prepare_output_task.fn(plan) == set()  # nothing was written


def test_tasks_pass_a_plan_of_shard_names_not_rows(jsonl_input, tmp_path, tiny_model):
    import pickle

    from tokenmill.pipelines.job import finalize_job

    spec = dataclasses.replace(
        make_spec(jsonl_input, tmp_path / "out", tiny_model), plan_window_rows=4
    )
    plan = plan_task.fn(spec)
    assert {s.window for s in plan.shards} == {0, 1, 2, 3}  # 16 rows, 4 a window
    # what each shard task receives: no prompt, token or id of any row
    shipped = pickle.dumps(plan)
    assert b"q003" not in shipped and b"Summarise" not in shipped
    assert prepare_output_task.fn(plan) == set()
    runs = [shard_task.fn(plan, s, plan.job_id) for s in plan.shards]
    ledger = finalize_job(plan, num_shards_run=len(runs))  # what ledger_task runs
    assert ledger.rows_ok + ledger.rows_failed == 16 == sum(r.result.num_rows for r in runs)
    assert not (tmp_path / "out" / "_plan").exists()


@pytest.mark.parametrize("raw", [False, True])
def test_prompts_follow_the_one_prompt_rule(jsonl_input, tmp_path, tiny_model, raw):
    from flow_helpers import prompt_rows

    from tokenmill.engine.loader.tokenizer import Tokenizer
    from tokenmill.pipelines.planning import load_shard
    from tokenmill.pipelines.spill import shard_rows

    spec = dataclasses.replace(make_spec(jsonl_input, tmp_path / "out", tiny_model), raw=raw)
    plan = plan_task.fn(spec)
    rows = {r.id: r for s in plan.shards for r in shard_rows(load_shard(plan, s)).rows}
    tokenizer = Tokenizer.from_dir(tiny_model)
    prompt = prompt_rows()[0]["prompt"]
    if raw:
        expected = tokenizer.encode(prompt)
    else:  # a user message through the tiny model's ChatML template
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        expected = tokenizer.encode(chat, add_special_tokens=False)
    assert list(rows["q000"].token_ids) == expected
