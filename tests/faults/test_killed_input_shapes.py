"""Input shapes (`tests/input_shapes.py`) through `tokenmill run` killed mid-job and
resumed: every row answered or named as an error, none dropped, and the ledger's
rows_read and rows_skipped_blank right after the resume - they are planned again from
the input by the run that finishes the job."""

from __future__ import annotations

import random

import pytest
from fault_jobs import shape_killed_and_resumed
from fault_matrix import RunContext, input_shapes
from input_shapes import write_input_shapes


@pytest.mark.parametrize(
    ("name", "fault"),
    [
        ("cr.csv", "engine_step:2"),
        pytest.param("rows.json", "write@ledger.json:1", marks=pytest.mark.slow),
    ],
)
def test_a_killed_job_resumes_with_every_record_counted(tmp_path, tiny_model_dir, name, fault):
    (shape,) = [s for s in write_input_shapes(tmp_path / "in") if s.path.name == name]

    outcome = shape_killed_and_resumed(tiny_model_dir, shape, tmp_path / "out", fault)

    assert outcome.ok, outcome
    assert (outcome.rows_lost, outcome.rows_duplicated, outcome.problems) == (0, 0, [])


@pytest.mark.slow
def test_the_fault_matrix_scenario_counts_nothing_lost(tmp_path, tiny_model_dir, fault_job):
    outcome = input_shapes(RunContext(fault_job, tmp_path, random.Random(3)))
    assert outcome.ok and (outcome.rows_lost, outcome.rows_duplicated) == (0, 0), outcome
