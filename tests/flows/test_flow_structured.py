"""The Prefect flow takes the structured outputs options as flat parameters, like the CLI."""

from __future__ import annotations

import json

import jsonschema
import pytest
from flow_helpers import job_parameters

from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_results

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 5}, "n": {"enum": [1, 2, 3]}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


def test_flow_enforces_a_schema_and_refuses_a_bad_one(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    params = job_parameters(jsonl_input, str(tmp_path / "out"), tiny_model, max_tokens=40)
    ledger = batch_inference(**params, json_schema=SCHEMA)
    rows = read_results(str(tmp_path / "out")).to_pylist()
    complete = [r for r in rows if r["structured_output_complete"]]
    assert ledger.rows_ok == len(rows) - 1 and len(complete) == ledger.rows_ok  # one null prompt
    for row in complete:
        jsonschema.validate(json.loads(row["output"]), SCHEMA)

    bad = job_parameters(jsonl_input, str(tmp_path / "bad"), tiny_model, max_tokens=40)
    state = batch_inference(**bad, json_schema={"not": {"type": "string"}}, return_state=True)
    assert state.is_failed()
    assert not (tmp_path / "bad" / "results").exists()  # failed in planning
