"""Fixtures for the Batch API: the tiny model, batch files, an in-process app driven with
FastAPI's TestClient, and the server started as a user starts it (`tokenmill batch-api`
in a subprocess) for the real `openai` client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/batch_api: api_helpers

from api_helpers import ApiServer, batch_lines, free_port  # noqa: E402
from postgres_server import URL_ENV, cluster, fresh_database, server_bin  # noqa: E402
from s3_server import S3Endpoint, moto_s3  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tm-cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def api(tmp_path, tiny_model_dir):
    """An app on a local store in tmp_path, its runner started, keys k-alice and k-bob."""
    server = ApiServer(tmp_path / "store", tiny_model_dir, spool_dir=tmp_path / "spool")
    with server.client() as client:
        yield server, client
    server.close()


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    with moto_s3(bucket="tokenmill-batch-api-test") as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """A Postgres server's URL: CI's (TOKENMILL_TEST_POSTGRES_URL), or a cluster started
    here from the installed binaries; skipped only when no server is installed."""
    import os

    if os.environ.get(URL_ENV):
        yield os.environ[URL_ENV]
        return
    bin_dir = server_bin()
    if bin_dir is None:
        pytest.skip("no Postgres server installed (Debian: apt-get install postgresql)")
    with cluster(bin_dir, free_port()) as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh database on the Postgres server."""
    return fresh_database(postgres_server)


__all__ = ["batch_lines"]
