"""Fixtures for the fault-injection suite: the tiny model, inputs, jobs, the S3 server."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/faults/: fault_jobs

from fault_jobs import FaultJob, write_input  # noqa: E402
from s3_server import S3Endpoint, moto_s3  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # The weights-hash memo lives in the tokenmill cache; keep it per session.
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tm-cache"))
    monkeypatch.delenv("TOKENMILL_FAULT_POINT", raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama model directory, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def fault_job(tmp_path, tiny_model_dir) -> FaultJob:
    """A 40-row CLI job on the tiny model, output in tmp_path/out."""
    return FaultJob(tiny_model_dir, write_input(tmp_path / "in.parquet"), tmp_path / "out")


@pytest.fixture
def fault_rng() -> random.Random:
    """A seeded RNG for choosing fault points; the seed is printed so a failure can be
    rerun with TOKENMILL_FAULT_SEED=<seed>."""
    seed = int(os.environ.get("TOKENMILL_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"fault seed: TOKENMILL_FAULT_SEED={seed}")
    rng = random.Random(seed)
    rng.seed_value = seed  # shown in assertion messages
    return rng


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    """moto's S3 server on loopback, with one bucket."""
    with moto_s3(bucket="tokenmill-faults-test") as endpoint:
        yield endpoint
