"""An embedding job (`--task embed`, a tiny random BERT embedding model) under the faults a
generation job survives: SIGKILL at random points then resume, an engine step that
raises, and object-store faults - one row per id, the ledger equal to the rows."""

from __future__ import annotations

import pytest
from fault_jobs import FaultJob, build_embedding_model, kill_and_resume, write_input
from store_fixtures import s3  # noqa: F401 - the moto server fixture
from store_scenarios import run_through_proxy, transient_rules


@pytest.fixture(scope="session")
def embedding_model_dir(tmp_path_factory):
    return build_embedding_model(tmp_path_factory.mktemp("embedding-model"))


@pytest.fixture
def embed_job(tmp_path, embedding_model_dir) -> FaultJob:
    return FaultJob(
        embedding_model_dir, write_input(tmp_path / "in.parquet"), tmp_path / "out", task="embed"
    )


def test_random_kills_then_resume(embed_job, fault_rng):
    specs = kill_and_resume(embed_job, fault_rng, num_points=5)
    outcome = embed_job.outcome()
    seed = f"seed {fault_rng.seed_value}, kills {specs}"
    assert outcome.ok and outcome.rows_failed == 0, f"{seed}: {outcome}"
    assert not (embed_job.output / "_plan").exists(), seed


def test_an_engine_step_that_raises_once_is_retried(embed_job):
    result = embed_job.run("engine_step:3:raise")
    assert result.returncode == 0, result.output[-1500:]
    outcome = embed_job.outcome()
    assert outcome.ok and outcome.rows_failed == 0, outcome


def test_object_store_faults_are_retried(s3, embedding_model_dir):  # noqa: F811
    from tokenmill.engine.api.llm import LLM

    llm = LLM(str(embedding_model_dir), dtype="float32", max_num_batched_tokens=16)
    run = run_through_proxy(s3, llm, transient_rules(), task="embed")
    assert run.error is None, run.error
    assert run.rows_lost == 0 and run.rows_duplicated == 0
    assert run.num_faults > 0 and run.num_shards > 1
