"""An embedding job as a flow run (`task="embed"`): on S3 (loopback moto), against the real
Prefect server, on a tiny random BERT embedding model, resumed by a rerun."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from flow_helpers import prompt_rows
from pooling_models import build_sentence_encoder

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_ledger, read_results

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> str:
    return str(build_sentence_encoder(tmp_path_factory.mktemp("encoder")))


def test_an_embedding_flow_on_s3(prefect_api, s3, encoder_dir, unique):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(prompt_rows()), buf)
    src = s3.url(f"embedding-{unique}/in/prompts.parquet")
    s3fs.S3FileSystem(**s3.storage_options).pipe(src, buf.getvalue())
    out = s3.url(f"embedding-{unique}/out")
    params = {
        "input": src,
        "output": out,
        "model": encoder_dir,
        "task": "embed",
        "id_column": "id",
        "passthrough": ["topic"],
        "shard_tokens": 48,
        "dimensions": 32,
        "price_input": 0.5,
        "dtype": "float32",
        "storage_options": {"endpoint_url": s3.endpoint_url},
    }
    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message
    ledger = state.result()

    opts = s3.storage_options
    results = read_results(out, opts)
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    rows = {r["id"]: r for r in results.to_pylist()}
    assert sorted(rows) == [f"q{i:03d}" for i in range(16)]
    assert rows["q007"]["finish_reason"] == "error" and rows["q007"]["embedding"] is None
    good = [r for r in rows.values() if r["id"] != "q007"]
    assert all(r["finish_reason"] == "embed" and len(r["embedding"]) == 32 for r in good)
    assert (ledger.task, ledger.rows_ok, ledger.rows_failed) == ("embed", 15, 1)
    assert ledger.completion_tokens == 0 and ledger.num_shards == ledger.num_shards_run > 2
    assert ledger.prompt_tokens == sum(r["prompt_tokens"] for r in good)
    assert read_ledger(out, opts) == ledger

    again = batch_inference(**params)  # the same parameters: the job resumes, all done
    assert again.job_id == ledger.job_id and again.num_shards_run == 0
