"""Faults on a Dask cluster started as an operator starts one (`dask scheduler` and
`dask worker --nthreads 1 --resources engine=1` processes, tests/faults/operator_cluster.py):
a worker SIGKILLed mid-shard that its nanny restarts, one that never comes back, the
scheduler restarted mid-job, the object store down for a while mid-job, and a cluster
whose workers offer no engine. Each ends with one row per id, or fails clearly (before
any compute, naming the lost scheduler, or naming the store) and resumes."""

from __future__ import annotations

import pytest
from operator_cluster import operator_cluster
from store_fixtures import JOB_OPTIONS, _isolated_cache, prefect_api, s3  # noqa: F401 - fixtures
from test_worker_death import NUM_ROWS, OPTIONS, pid_is_alive, write_prompts
from tiny_model import build_tiny_model
from worker_scenarios import (
    run_with_scheduler_restart,
    run_with_store_outage,
    run_with_worker_death,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("nanny", [True, False], ids=["restarted", "never-back"])
def test_a_worker_killed_mid_shard_on_an_operator_cluster(prefect_api, tmp_path, nanny):  # noqa: F811
    model = build_tiny_model(tmp_path / "tiny")
    src = write_prompts(tmp_path / "prompts.jsonl")
    with operator_cluster(tmp_path / "cluster", 2, nanny=nanny) as cluster:
        run = run_with_worker_death(
            src,
            str(tmp_path / "out"),
            str(model),
            str(tmp_path / "kill.marker"),
            kill_at=2,
            scheduler_address=cluster.address,
            **OPTIONS,
        )
        alive = [w.poll() is None for w in cluster.workers]
    assert run.killed_pid is not None, "the fault hook never fired"
    assert not pid_is_alive(run.killed_pid)
    if not nanny:  # the killed worker was the `dask worker` process itself
        assert alive.count(False) == 1, alive
    assert run.completed, run.message
    assert (run.rows_lost, run.rows_duplicated) == (0, 0)
    assert run.ledger_rows == NUM_ROWS and run.num_shards > 2
    assert (run.num_parts, run.num_temp_files) == (run.num_shards, 0)


def test_workers_without_the_engine_resource_are_refused_before_planning(prefect_api, tmp_path):  # noqa: F811
    from tokenmill.flows import batch_inference, make_task_runner

    model = build_tiny_model(tmp_path / "tiny")
    src = write_prompts(tmp_path / "prompts.jsonl")
    with operator_cluster(tmp_path / "cluster", 1, resources=None) as cluster:
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.address)
        )
        state = flow(
            input=src, output=str(tmp_path / "out"), model=str(model), return_state=True, **OPTIONS
        )
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="1 worker\\(s\\) and none offers the 'engine'"):
        state.result()
    assert not (tmp_path / "out").exists()


# Two flow runs on a cluster started twice: 76 s on an idle 2-core machine. The named
# failure it checks is also checked, fast, by tests/flows/test_shard_wait.py.
@pytest.mark.slow
def test_a_scheduler_restarted_mid_job_fails_by_name_and_resumes(prefect_api, tmp_path):  # noqa: F811
    model = build_tiny_model(tmp_path / "tiny")
    src = write_prompts(tmp_path / "prompts.jsonl")
    with operator_cluster(tmp_path / "cluster", 2) as cluster:
        run = run_with_scheduler_restart(
            cluster, src, str(tmp_path / "out"), str(model), after_parts=2, **OPTIONS
        )
    assert run.restarted, "the scheduler was never restarted"
    # The flow's Dask client loses its scheduler: every future it held is cancelled, so the
    # run fails at once, naming the cause, instead of waiting on shards that will never end.
    assert not run.first_completed
    assert "cancelled by the task runner (" in run.first_message
    assert "scheduler-connection-lost" in run.first_message
    assert run.rerun_completed
    assert (run.rows_lost, run.rows_duplicated, run.num_temp_files) == (0, 0, 0)


# A flow on two workers, failed by the outage and run again: about a minute on an idle
# 2-core machine. The same outage on an in-process job, and its named StoreError, are
# checked fast by tests/faults/test_store_faults.py.
@pytest.mark.slow
def test_a_store_down_mid_job_on_an_operator_cluster_fails_by_name_and_resumes(
    prefect_api,  # noqa: F811
    s3,  # noqa: F811
    tmp_path,
):
    model = build_tiny_model(tmp_path / "tiny")
    with operator_cluster(tmp_path / "cluster", 2) as cluster:
        # Down for 12 s: past the 3 attempts of the tests' store policy, so the shards
        # running then fail, however the outage falls.
        run = run_with_store_outage(
            cluster, s3, str(model), outage_s=12.0, prefix="operator-outage", **JOB_OPTIONS
        )
    assert run.num_faults > 0, "the store never went down"
    assert not run.first_completed
    assert "shard tasks did not complete" in run.first_message, run.first_message
    assert run.rerun_completed
    assert (run.rows_lost, run.rows_duplicated, run.num_temp_files) == (0, 0, 0)
    assert run.num_parts == run.num_shards > 2
