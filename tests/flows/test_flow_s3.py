"""A flow run over a dataset on S3 (loopback moto) writes results and ledger back to S3,
and publishes the ledger as artifacts whose figures are the ledger's."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from flow_helpers import job_parameters, prompt_rows
from prefect import get_client
from prefect.blocks.system import Secret
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)

from tokenmill.flows import batch_inference
from tokenmill.flows.artifacts import TABLE_FIGURES, artifact_key, ledger_table
from tokenmill.pipelines.output import read_ledger, read_ledger_dataset, read_results

pytestmark = pytest.mark.integration

SECRET = "sekrit-flow-5d1e"  # moto accepts any secret: this one can be searched for


def upload_parquet(s3, key: str) -> str:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(prompt_rows()), buf)
    s3fs.S3FileSystem(**s3.storage_options).pipe(s3.url(key), buf.getvalue())
    return s3.url(key)


def test_flow_on_s3_writes_results_ledger_and_artifacts(prefect_api, s3, tiny_model, unique):
    src = upload_parquet(s3, f"flows-{unique}/in/prompts.parquet")
    out = s3.url(f"flows-{unique}/out")
    # Credentials (and here the endpoint too) travel in a Secret block, not in parameters:
    # without the block's endpoint the job could not even find the bucket.
    options = {"endpoint_url": s3.endpoint_url, "key": "testing", "secret": SECRET}
    Secret(value=options).save(f"tm-s3-{unique}", overwrite=True)

    state = batch_inference(
        **job_parameters(src, out, tiny_model, storage_secret=f"tm-s3-{unique}"),
        return_state=True,
    )
    assert state.is_completed(), state.message
    ledger = state.result()

    results = read_results(out, options)
    ids = results["id"].to_pylist()
    assert sorted(ids) == [f"q{i:03d}" for i in range(16)]  # exactly one row per input id
    assert (ledger.rows_ok, ledger.rows_failed) == (15, 1)  # q007 has a null prompt
    assert ledger.completion_tokens == sum(results["completion_tokens"].to_pylist())
    assert results["topic"].to_pylist() == [int(i[1:]) % 3 for i in ids]  # passthrough
    assert read_ledger(out, options) == ledger
    assert read_ledger_dataset(f"{out}/ledger", options)["job_id"].to_pylist() == [ledger.job_id]
    assert ledger.num_shards == ledger.num_shards_run > 2

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        )

    by_key = {a.key: a for a in artifacts}
    table = by_key[artifact_key("ledger", ledger.job_id)]
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows == ledger_table(read_ledger(out, options))  # the ledger as written
    assert [r["figure"] for r in rows] == [label for label, *_ in TABLE_FIGURES]
    summary = by_key[artifact_key("summary", ledger.job_id)]
    assert summary.type == "markdown"
    assert ledger.job_id in summary.data and f"{ledger.prompt_tokens:,} prompt" in summary.data

    # Names say what runs are; nothing secret was stored with the run or written to S3.
    assert flow_run.name == f"job {ledger.job_id} -> {out}"
    names = sorted(t.name for t in task_runs)
    shard_names = [n for n in names if " shard-" in n]
    assert len(shard_names) == ledger.num_shards
    assert all(n.startswith(f"job-{ledger.job_id} shard-000") for n in shard_names)
    assert f"ledger job-{ledger.job_id}" in names and f"plan {src}" in names
    assert SECRET not in json.dumps(flow_run.parameters)
    fs = s3fs.S3FileSystem(**options)
    for path in fs.find(f"{s3.bucket}/flows-{unique}"):
        assert SECRET.encode() not in fs.cat(path), path
