"""Which failures the I/O tasks retry."""

from __future__ import annotations

import errno

import pytest

from tokenmill.connectors import SourceError
from tokenmill.connectors.errors import DiskFullError
from tokenmill.flows.retries import is_transient, retry_shard, retry_transient


class ReadTimeoutError(Exception):
    """Named like botocore's, which is not an OSError."""


class ServerDisconnectedError(Exception):
    """Named like aiohttp's."""


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError(),
        TimeoutError(),
        OSError(5, "EIO"),
        ReadTimeoutError(),
        ServerDisconnectedError(),
    ],
)
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("gone"),
        PermissionError("denied"),
        FileExistsError("there"),
        DiskFullError(errno.ENOSPC, "disk full"),
        SourceError("bad column"),
        ValueError("bad"),
        RuntimeError("incomplete"),
    ],
)
def test_permanent(exc):
    assert not is_transient(exc)


class FakeState:
    def __init__(self, exc):
        self.exc = exc

    def result(self, raise_on_failure=True):
        return self.exc


def test_shard_tasks_also_retry_a_part_published_under_them():
    assert retry_shard(None, None, FakeState(FileExistsError("part exists")))
    assert not retry_transient(None, None, FakeState(FileExistsError("part exists")))
    assert retry_transient(None, None, FakeState(ConnectionError()))
    assert not retry_shard(None, None, FakeState(ValueError()))
    assert not retry_transient(None, None, FakeState("a plain value"))
