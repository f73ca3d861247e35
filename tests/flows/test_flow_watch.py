"""A flow a person can watch: its progress artifact, each shard's log line, retry delays
Prefect's UI can show, a dry run's forecast - and fan-out that uses every worker."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from flow_helpers import job_parameters
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)

from tokenmill.flows import batch_inference, make_task_runner
from tokenmill.flows.artifacts import artifact_key, progress_text
from tokenmill.flows.progress import job_snapshot
from tokenmill.flows.runners import num_workers
from tokenmill.flows.tasks import plan_task, shard_task
from tokenmill.pipelines import shared_llm
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.output import read_forecast, read_ledger
from tokenmill.pipelines.planning import plan_job
from tokenmill.pipelines.report import money
from tokenmill.pipelines.spec import JobSpec

pytestmark = pytest.mark.integration


def _artifacts(flow_run_id) -> dict:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found}


def _logs(flow_run_id, pattern: str, count: int, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
            )
        found = [log.message for log in logs if re.search(pattern, log.message)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_progress_artifact_and_shard_lines(prefect_api, jsonl_input, tmp_path, tiny_model):
    out = tmp_path / "out"
    state = batch_inference(**job_parameters(jsonl_input, str(out), tiny_model), return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()
    flow_run_id = state.state_details.flow_run_id
    progress = _artifacts(flow_run_id)[artifact_key("progress", ledger.job_id)]
    assert progress.type == "progress" and progress.data == 100.0
    # the last figures: every row and every billed token, the cost at the job's prices
    tokens = ledger.prompt_tokens + ledger.completion_tokens
    assert progress.description.startswith(f"16 of 16 rows, {tokens:,} of {tokens:,} tokens")
    assert f"cost so far {money(ledger.cost_total)}" in progress.description
    assert "tok/s; ETA 0 s" in progress.description
    lines = _logs(flow_run_id, r"shard \S+: .* tokens .* tok/s, cost \$", ledger.num_shards)
    assert len(lines) == ledger.num_shards
    assert not (out / "_progress").exists()  # records go when the job finishes
    table = _artifacts(flow_run_id)[artifact_key("ledger", ledger.job_id)]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    figures = {row["figure"]: row["value"] for row in rows}
    assert figures["model"].startswith("tiny (") and figures["device"] == "cpu"
    assert figures["price device"] == "not set"


def test_shard_retry_delay_is_a_number_in_the_api(prefect_api, jsonl_input, tmp_path, tiny_model):
    state = batch_inference(
        **job_parameters(jsonl_input, str(tmp_path / "out"), tiny_model, shard_tokens=4096),
        return_state=True,
    )
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    shard_runs = [r for r in runs if " shard-" in r.name]
    assert shard_runs
    for run in shard_runs:  # Prefect's UI formats this as seconds: a list reads "NaNs"
        assert isinstance(run.empirical_policy.retry_delay, (int, float))
        assert run.empirical_policy.retries == 2
    assert isinstance(shard_task.retry_delay_seconds, (int, float))


def test_dry_run_flow_returns_and_publishes_the_forecast(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    out = tmp_path / "out"
    params = job_parameters(jsonl_input, str(out), tiny_model)
    state = batch_inference(**params, dry_run=True, calibrate=False, return_state=True)
    assert state.is_completed(), state.message
    forecast = state.result()
    assert isinstance(forecast, Forecast) and forecast.rows == 16
    assert sorted(p.name for p in out.iterdir()) == ["_forecast.json"]
    summary = _artifacts(state.state_details.flow_run_id)[artifact_key("forecast", forecast.job_id)]
    assert f"{forecast.prompt_tokens:,} (exact)" in summary.data
    # The forecast is for a cold prefix cache, as a new worker has; this process's shared
    # engine is warm from the tests before.
    shared_llm.clear()
    ledger = batch_inference(**params)
    assert (ledger.prompt_tokens, ledger.cached_tokens) == (
        forecast.prompt_tokens,
        forecast.cached_tokens,
    )
    assert read_ledger(str(out)).forecast_prompt_tokens == forecast.prompt_tokens
    assert read_forecast(str(out))["job_id"] == ledger.job_id


def test_job_snapshot_adds_up_the_shards_records(tmp_path, jsonl_input, tiny_model):
    spec = JobSpec(
        jsonl_input, str(tmp_path / "out"), model=tiny_model, shard_tokens=48, max_tokens=6
    )
    plan = plan_job(spec)
    first, second, *rest = plan.shards
    records = {
        first.shard_id: {  # done: ran 5 s
            "rows_done": first.num_rows,
            "tokens_done": 50,
            "tokens_total": 50,
            "prompt_computed": 30,
            "prompt_cached": 10,
            "generated": 10,
            "started": 1000.0,
            "updated": 1005.0,
            "eta_s": 0.0,
            "done": True,
        },
        second.shard_id: {  # running: its record, 2 s old, said 6 s to go
            "rows_done": 1,
            "tokens_done": 20,
            "tokens_total": second.num_tokens,
            "prompt_computed": 20,
            "prompt_cached": 0,
            "generated": 0,
            "started": 1004.0,
            "updated": 1008.0,
            "eta_s": 6.0,
            "done": False,
        },
    }
    snap = job_snapshot(plan, plan.shards, records, now=1010.0)
    total = 50 + second.num_tokens + sum(s.num_tokens for s in rest)
    assert (snap.rows_done, snap.rows_total) == (first.num_rows + 1, 16)
    assert (snap.tokens_done, snap.tokens_total) == (70, total)
    # the running shard's 4 s left, then the unstarted shards' planned tokens at the
    # seconds per planned token the started ones take: 5 + (4 + 4) s for their tokens
    per_token = (5.0 + 8.0) / (first.num_tokens + second.num_tokens)
    eta = 4.0 + sum(s.num_tokens for s in rest) * per_token
    assert snap.eta_s == pytest.approx(eta)
    assert snap.tokens_per_s == pytest.approx(total / (10.0 + eta))
    # two workers share the queue; never sooner than the running shard
    two = job_snapshot(plan, plan.shards, records, now=1010.0, workers=2)
    assert two.eta_s == pytest.approx(max(eta / 2, 4.0))
    assert snap.cost is None  # no prices in this job
    assert progress_text(snap).startswith(f"{first.num_rows + 1} of 16 rows, 70 of {total:,}")


def test_a_two_worker_cluster_gets_two_shards_and_both_compute(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    """A job that fits one shard is cut in two for two workers; each worker's engine
    computes on its share of the cores."""
    params = job_parameters(jsonl_input, str(tmp_path / "out"), tiny_model, shard_tokens=100_000)
    alone = plan_task.fn(JobSpec(**params))
    assert len(alone.shards) == 1
    on_dask = batch_inference.with_options(task_runner=make_task_runner(dask_workers=2))
    state = on_dask(**params, return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()
    assert ledger.num_shards == 2
    lines = _logs(state.state_details.flow_run_id, r"on worker (\S+)", 2)
    # Each shard needs the one engine slot a worker offers, so the two never run on one
    # worker at once (test_placement.py); but shards this short can finish before the
    # second is placed, and a free worker may then take both in turn. What the flow
    # guarantees here is two shards, each computed on a worker's share of the cores.
    assert len(lines) == 2, lines
    # the machine's cores shared between the two workers on it
    cores = len(os.sched_getaffinity(0))
    threads = {int(re.search(r"compute threads: (\d+)", line).group(1)) for line in lines}
    assert threads == {max(1, cores // 2)}, lines
    assert read_ledger(str(tmp_path / "out")).num_shards_run == 2


def test_num_workers_of_the_runners():
    assert num_workers(make_task_runner()) == 1
    assert num_workers(make_task_runner(dask_workers=3)) == 3


def test_a_job_too_small_for_its_workers_says_so(prefect_api, tmp_path, tiny_model, monkeypatch):
    from tokenmill.flows import batch_flow

    monkeypatch.setattr(batch_flow, "num_workers", lambda runner: 3)
    path = tmp_path / "two.jsonl"
    path.write_text('{"id": "a", "prompt": "Hello there"}\n{"id": "b", "prompt": null}\n')
    params = job_parameters(str(path), str(tmp_path / "out"), tiny_model)
    del params["passthrough"]
    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message
    lines = _logs(state.state_details.flow_run_id, r"worker\(s\) will idle", 1)
    assert lines and "1 shard(s) to compute for 3 workers: 2 worker(s) will idle" in lines[0]
