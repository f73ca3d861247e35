"""The flow over CSV on S3 with a 40 MB field and a row that is not UTF-8: the good rows
are answered, each bad row is one error row naming its line in its S3 file."""

from __future__ import annotations

import pytest
import s3fs
from flow_helpers import job_parameters
from hostile_bytes import write_hostile_inputs

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["field.csv", "bom.csv.gz"])
def test_flow_reads_bad_bytes_and_big_fields_from_s3(
    prefect_api, s3, tiny_model, unique, tmp_path, name
):
    (hostile,) = [h for h in write_hostile_inputs(tmp_path) if h.path.name == name]
    src, out = s3.url(f"flows-{unique}/in/{name}"), s3.url(f"flows-{unique}/out")
    s3fs.S3FileSystem(**s3.storage_options).put_file(str(hostile.path), src)

    # The credentials come from the environment moto's fixture sets, not from parameters.
    endpoint = {"endpoint_url": s3.endpoint_url}
    state = batch_inference(
        **job_parameters(src, out, tiny_model, passthrough=[], storage_options=endpoint),
        return_state=True,
    )

    assert state.is_completed(), state.message
    ledger = state.result()
    results = read_results(out, s3.storage_options)
    assert hostile.check(results, shown_as=src) == (0, 0)
    assert (ledger.rows_ok, ledger.rows_failed) == (3, 1)
