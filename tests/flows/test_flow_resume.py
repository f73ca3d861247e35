"""A flow run killed midway, then run again with the same parameters, finishes the job:
exactly one result row per input id, and no completed shard computed again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flow_helpers import job_parameters

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("flow_child.py")


def completed_parts(output: Path) -> dict[str, tuple[int, bytes]]:
    """Published parts (hidden temp files excluded): name -> (mtime_ns, bytes)."""
    results = output / "results"
    if not results.is_dir():
        return {}
    return {
        p.name: (p.stat().st_mtime_ns, p.read_bytes())
        for p in results.glob("*.parquet")
        if not p.name.startswith((".", "_"))
    }


def test_killed_flow_resumes_without_recomputing(prefect_api, jsonl_input, tmp_path, tiny_model):
    output = tmp_path / "out"
    params = job_parameters(jsonl_input, str(output), tiny_model)
    child = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(params), "2.0"],
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not completed_parts(output):
            assert child.poll() is None, "the flow ended before any shard completed"
            assert time.monotonic() < deadline, "no shard completed in time"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    before = completed_parts(output)
    stats_before = {p.name: p.read_bytes() for p in (output / "shard_stats").glob("*.json")}

    ledger = batch_inference(**params)

    assert 0 < len(before) < ledger.num_shards  # killed midway, for real
    assert ledger.num_shards_run == ledger.num_shards - len(before)
    after = completed_parts(output)
    assert len(after) == ledger.num_shards
    for name, (mtime, data) in before.items():
        assert after[name] == (mtime, data), f"{name} was rewritten"
        stats = name.replace(".parquet", ".json")
        assert (output / "shard_stats" / stats).read_bytes() == stats_before[stats]
    results = read_results(str(output))
    ids = results["id"].to_pylist()
    assert sorted(ids) == [f"q{i:03d}" for i in range(16)]
    assert ledger.rows_ok + ledger.rows_failed == 16
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())
    assert ledger.completion_tokens == sum(results["completion_tokens"].to_pylist())


def test_a_failed_shard_fails_the_run_but_keeps_the_others(
    prefect_api, jsonl_input, tmp_path, tiny_model, monkeypatch
):
    import tokenmill.flows.tasks as tasks

    output = tmp_path / "out"
    params = job_parameters(jsonl_input, str(output), tiny_model)
    real_run_shard = tasks.run_shard
    calls = []

    def failing_run_shard(llm, plan, shard, **kwargs):
        calls.append(shard.shard_id)
        if shard.index == 1:
            raise ValueError("this shard cannot be computed")  # not transient: no retry
        return real_run_shard(llm, plan, shard, **kwargs)

    monkeypatch.setattr(tasks, "run_shard", failing_run_shard)
    state = batch_inference(**params, return_state=True)
    assert state.is_failed()
    assert "1 of" in state.message and "run the flow again" in state.message
    parts = completed_parts(output)
    assert len(parts) == len(set(calls)) - 1  # every other shard finished and was kept
    assert sum(c.startswith("00001-") for c in calls) == 1  # a ValueError is not retried
    assert not (output / "ledger.json").exists()

    monkeypatch.setattr(tasks, "run_shard", real_run_shard)
    ledger = batch_inference(**params)
    assert ledger.num_shards_run == 1 and ledger.num_shards == len(parts) + 1
    assert read_results(str(output)).num_rows == 16
