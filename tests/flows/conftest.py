"""Fixtures for the flow tests: a real Prefect server, a tiny model, small datasets.

The server: CI starts one and exports PREFECT_API_URL; without it, the first test
that needs it starts `prefect server start` on a free loopback port (SQLite in a
temporary PREFECT_HOME) and stops it with SIGTERM when the session ends. Unit tests
call task functions through `task.fn(...)` and need no server at all.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

# Before prefect is imported anywhere: its settings are read once, at import.
os.environ["DO_NOT_TRACK"] = "1"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="tokenmill-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "60")

import pytest  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS_DIR))  # tests/ holds shared helpers; it is not a package

from flow_helpers import prompt_rows  # noqa: E402
from s3_server import S3Endpoint, moto_s3  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

SERVER_START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _start_server(home: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        + ["--analytics-off"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _healthy(api_url):
            return process, api_url
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(
        f"prefect server did not become healthy:\n{(home / 'server.log').read_text()[-3000:]}"
    )


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> str:
    """The Prefect API URL every flow in the session reports to."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api_url = os.environ.get("PREFECT_API_URL")
    process = None
    if not api_url:
        process, api_url = _start_server(tmp_path_factory.mktemp("prefect-server"))
        # Subprocesses (Dask workers, `tokenmill serve`) read it from the environment.
        os.environ["PREFECT_API_URL"] = api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield api_url
        # Ship the logs still queued in this process while the server can take them.
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
    finally:
        if process is not None:
            os.environ.pop("PREFECT_API_URL", None)
            _stop(process)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # weights_hash remembers file digests in the tokenmill cache; keep tests out of ~/.cache.
    # Set in os.environ, so Dask workers and `tokenmill serve` subprocesses inherit it.
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tm-cache"))


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture
def jsonl_input(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    return str(path)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:10]
