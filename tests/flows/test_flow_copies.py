"""Duplicate rows in a flow: the copy shard is written by the compute shard task that
publishes its last source, not by a task queued after every compute shard; a copy
shard left unpublished (a run killed in between) runs as a task of its own on resume.
Either way each id has one row and the ledger sums the rows."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from flow_helpers import job_parameters, prompt_rows
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.integration

NUM_REPEATS = 6  # rows 16..21 repeat rows 0..5 (row 7, a null prompt, is never a source)


def _input(tmp_path) -> str:
    rows = prompt_rows()
    rows += [{**rows[i], "id": f"q{16 + i:03d}"} for i in range(NUM_REPEATS)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _shard_task_names(state) -> list[str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    return sorted(r.name for r in runs if " shard-" in r.name), runs


def _check_rows(output: str, ledger) -> None:
    results = read_results(output)
    assert sorted(results["id"].to_pylist()) == [f"q{i:03d}" for i in range(16 + NUM_REPEATS)]
    assert ledger.rows_deduplicated == NUM_REPEATS
    assert ledger.rows_ok + ledger.rows_failed == 16 + NUM_REPEATS
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())
    assert ledger.completion_tokens == sum(results["completion_tokens"].to_pylist())
    by_id = {r["id"]: r for r in results.to_pylist()}
    for i in range(NUM_REPEATS):
        copy, source = by_id[f"q{16 + i:03d}"], by_id[f"q{i:03d}"]
        assert (copy["duplicate_of"], copy["output"]) == (source["id"], source["output"])


def test_copies_are_written_by_the_last_source_task_and_resume(prefect_api, tmp_path, tiny_model):
    output = tmp_path / "out"
    params = job_parameters(_input(tmp_path), str(output), tiny_model)
    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()
    _check_rows(str(output), ledger)
    copies = sorted(p.stem for p in (output / "results").glob("copies-*.parquet"))
    assert len(copies) == 1 and ledger.num_shards > 2
    assert ledger.num_shards_run == ledger.num_shards  # the copy shard counts as run

    # No task of its own for the copy shard: a compute shard task wrote it, before ending.
    names, runs = _shard_task_names(state)
    assert len(names) == ledger.num_shards - 1
    assert not any("shard-copies-" in n for n in names)
    stats = json.loads((output / "shard_stats" / f"{copies[0]}.json").read_text())
    last_task_end = max(r.end_time for r in runs if " shard-" in r.name)
    assert datetime.fromisoformat(stats["finished_at"]) <= last_task_end

    # A run killed after the compute shards, before the copies: the rerun's copy shard
    # runs as a task of its own, and nothing else is computed again.
    (output / "results" / f"{copies[0]}.parquet").unlink()
    (output / "shard_stats" / f"{copies[0]}.json").unlink()
    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()
    assert ledger.num_shards_run == 1
    _check_rows(str(output), ledger)
    names, _ = _shard_task_names(state)
    assert names == [f"job-{ledger.job_id} shard-{copies[0]}"]
