"""The input shapes (`tests/input_shapes.py`) through the flow: its tasks for each shape
(`task.fn`, no server), and one real flow run over a bare-CR CSV holding quoted CRLF
fields: every row answered or named as an error, and the ledger's counts add up."""

from __future__ import annotations

import pytest
from flow_helpers import ENGINE, job_parameters
from input_shapes import write_input_shapes

from tokenmill.flows import batch_inference
from tokenmill.flows.tasks import plan_task, prepare_output_task, shard_task
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.spec import JobSpec

SHAPES = ["cr.csv", "semi.csv", "tabs.tsv", "pipe.csv", "rows.json", "lines.jsonl"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return {s.path.name: s for s in write_input_shapes(tmp_path_factory.mktemp("shapes"))}


@pytest.mark.parametrize("name", SHAPES)
def test_flow_tasks_answer_or_name_every_row(shapes, name, tmp_path, tiny_model):
    shape = shapes[name]
    spec = JobSpec(
        str(shape.path),
        str(tmp_path / "out"),
        model=tiny_model,
        id_column="id",
        passthrough=["prompt"],
        max_tokens=2,
        shard_tokens=24,
        **shape.options,
        **ENGINE,
    )

    plan = plan_task.fn(spec, min_shards=2)
    assert prepare_output_task.fn(plan) == set()
    for shard in plan.shards:
        shard_task.fn(plan, shard, plan.job_id)
    ledger = finalize_job(plan, num_shards_run=len(plan.shards))

    assert (plan.rows_read, plan.rows_skipped_blank) == (shape.rows_read, shape.blank)
    assert (ledger.rows_ok, ledger.rows_failed) == (
        len(shape.rows) - shape.rows_failed,
        shape.rows_failed,
    )
    assert ledger.rows_read == ledger.rows_ok + ledger.rows_failed + ledger.rows_skipped_blank
    assert shape.check(read_results(spec.output)) == (0, 0)


@pytest.mark.integration
def test_a_flow_run_reads_a_bare_cr_csv(prefect_api, shapes, tmp_path, tiny_model):
    shape = shapes["cr.csv"]
    out = str(tmp_path / "out")

    state = batch_inference(
        **job_parameters(str(shape.path), out, tiny_model, passthrough=["prompt"]),
        return_state=True,
    )

    assert state.is_completed(), state.message
    ledger = state.result()
    assert (ledger.rows_ok, ledger.rows_failed, ledger.rows_skipped_blank) == (4, 0, 1)
    assert ledger.rows_read == 5
    assert shape.check(read_results(out)) == (0, 0)
