"""Shards fan out over a 2-worker local Dask cluster: both workers compute, each loads
the engine once, and greedy results equal the single-process run's."""

from __future__ import annotations

import re
import time

import pytest
from flow_helpers import job_parameters
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from tokenmill.flows import batch_inference, make_task_runner
from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.integration

# A shard's line: its rows, tokens, tokens/s and cost, and where it ran.
SHARD_LOG = re.compile(
    r"shard (\S+): [\d,]+ rows \(.*\), [\d,]+ tokens \(.*\) in .* s, .*, cost .* "
    r"on worker (\S+) \(engines loaded by this worker: (\d+), compute threads: \d+\)"
)
# cached_tokens depends on which shards shared an engine's prefix cache, so it may differ.
COMPARED = ["id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error", "topic"]


def shard_logs(flow_run_id, num_shards: int, timeout_s: float = 30.0) -> list[tuple[str, ...]]:
    """(shard id, worker, engine loads) from the shard tasks' logs, as the API has them."""
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
            )
        found = [m.groups() for log in logs if (m := SHARD_LOG.search(log.message))]
        # Workers ship their logs in the background: wait for all of them.
        if len(found) >= num_shards or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def by_id(table):
    return sorted(zip(*(table[c].to_pylist() for c in COMPARED)))


def test_dask_workers_share_the_shards(prefect_api, jsonl_input, tmp_path, tiny_model):
    single = batch_inference(**job_parameters(jsonl_input, str(tmp_path / "single"), tiny_model))

    on_dask = batch_inference.with_options(task_runner=make_task_runner(dask_workers=2))
    state = on_dask(
        **job_parameters(jsonl_input, str(tmp_path / "dask"), tiny_model), return_state=True
    )
    assert state.is_completed(), state.message
    ledger = state.result()

    assert ledger.num_shards == single.num_shards >= 6
    dask_results = read_results(str(tmp_path / "dask"))
    assert dask_results.num_rows == 16
    assert by_id(dask_results) == by_id(read_results(str(tmp_path / "single")))
    assert (ledger.prompt_tokens, ledger.completion_tokens) == (
        single.prompt_tokens,
        single.completion_tokens,
    )

    logged = shard_logs(state.state_details.flow_run_id, ledger.num_shards)
    assert sorted(shard for shard, _, _ in logged) == sorted(
        p.stem for p in (tmp_path / "dask" / "results").glob("*.parquet")
    )
    workers = {worker for _, worker, _ in logged}
    assert len(workers) == 2, logged  # both workers computed shards
    # ... and each loaded its engine once, on its first shard, then reused it.
    assert {loads for _, _, loads in logged} == {"1"}
