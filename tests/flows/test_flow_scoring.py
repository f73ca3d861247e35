"""A scoring job as a flow run (`task="score"`): on S3 (loopback moto), against the real
Prefect server, resumed by a rerun with the same parameters."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from flow_helpers import ENGINE, prompt_rows
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from tokenmill.flows import batch_inference
from tokenmill.flows.artifacts import artifact_key
from tokenmill.pipelines.output import read_ledger, read_ledger_dataset, read_results
from tokenmill.pipelines.results import SCORE_RESULT_SCHEMA

pytestmark = pytest.mark.integration


def test_a_scoring_flow_on_s3(prefect_api, s3, tiny_model, unique):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(prompt_rows()), buf)
    src = s3.url(f"scoring-{unique}/in/prompts.parquet")
    s3fs.S3FileSystem(**s3.storage_options).pipe(src, buf.getvalue())
    out = s3.url(f"scoring-{unique}/out")
    params = {
        "input": src,
        "output": out,
        "model": tiny_model,
        "task": "score",
        "id_column": "id",
        "passthrough": ["topic"],
        "shard_tokens": 48,
        "price_input": 0.5,
        "storage_options": {"endpoint_url": s3.endpoint_url},  # credentials: the env's
        **ENGINE,
    }

    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()

    opts = s3.storage_options
    results = read_results(out, opts)
    assert results.schema.names == [*SCORE_RESULT_SCHEMA.names, "topic"]
    assert sorted(results["id"].to_pylist()) == [f"q{i:03d}" for i in range(16)]
    rows = {r["id"]: r for r in results.to_pylist()}
    assert rows["q007"]["finish_reason"] == "error"  # its prompt is null
    scored = [r for r in rows.values() if r["id"] != "q007"]
    assert {r["finish_reason"] for r in scored} == {"score"}
    assert all(r["perplexity"] > 1 and r["completion_tokens"] == 0 for r in scored)
    assert (ledger.task, ledger.rows_ok, ledger.rows_failed) == ("score", 15, 1)
    assert ledger.prompt_tokens == sum(r["prompt_tokens"] for r in scored)
    assert ledger.completion_tokens == 0 and ledger.num_shards == ledger.num_shards_run > 2
    assert read_ledger(out, opts) == ledger
    assert read_ledger_dataset(f"{out}/ledger", opts)["task"].to_pylist() == ["score"]

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    assert flow_run.parameters["task"] == "score"
    summary = {a.key: a for a in artifacts}[artifact_key("summary", ledger.job_id)]
    assert "- **task**: score" in summary.data

    again = batch_inference(**params)  # the same parameters: the job resumes, all done
    assert again.job_id == ledger.job_id and again.num_shards_run == 0
    assert again.prompt_tokens == ledger.prompt_tokens
