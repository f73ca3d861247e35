"""Fixtures for the pipelines tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_model

from pipeline_fakes import CharTokenizer, FakeLLM  # noqa: E402
from s3_server import S3Endpoint, moto_s3  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # weights_hash remembers file digests in the tokenmill cache; keep tests out of ~/.cache
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tm-cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama model directory, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def tokenizer():
    return CharTokenizer()


@pytest.fixture
def fake_llm(tiny_model_dir):
    return FakeLLM(model_dir=tiny_model_dir)


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    """moto's S3 server on loopback, with one bucket."""
    # moto keeps buckets process-wide; a bucket of our own avoids clashing with other suites
    with moto_s3(bucket="tokenmill-pipelines-test") as endpoint:
        yield endpoint
