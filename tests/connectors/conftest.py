"""Fixtures for connector tests: a loopback S3 server and small sample datasets."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
import uuid
from pathlib import Path

import pytest

# tests/ is not a package; its helpers are importable once it is on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3_server import S3Endpoint, moto_s3  # noqa: E402


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def s3_prefix(s3: S3Endpoint) -> str:
    """A fresh `s3://bucket/<unique>` prefix, so tests never see each other's objects."""
    return s3.url(f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def memory_root() -> str:
    """A fresh `memory://` directory (the in-memory filesystem is process-wide)."""
    return f"memory://tm-{uuid.uuid4().hex[:10]}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def http_root(tmp_path_factory) -> tuple[str, Path]:
    """A read-only HTTP server on loopback: `(base_url, directory it serves)`."""
    directory = tmp_path_factory.mktemp("http")
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", directory
    server.shutdown()
    server.server_close()
