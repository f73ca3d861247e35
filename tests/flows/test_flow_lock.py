"""The flow holds the output lock too: a flow run on an output another run holds is
refused before it plans anything, and runs once the lock is released."""

from __future__ import annotations

import pytest
from flow_helpers import job_parameters

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output_lock import OutputLockedError, output_lock

pytestmark = pytest.mark.integration


def test_flow_on_a_locked_output_is_refused(prefect_api, jsonl_input, tmp_path, tiny_model):
    output = tmp_path / "out"
    params = job_parameters(jsonl_input, str(output), tiny_model)
    with output_lock(str(output)), pytest.raises(OutputLockedError, match="is in use by run"):
        batch_inference(**params)
    assert not (output / "results").exists() and not (output / "_plan").exists()
    ledger = batch_inference(**params)
    assert ledger.rows_ok > 0 and ledger.num_shards_run == ledger.num_shards
    assert not (output / "_lock.json").exists()
