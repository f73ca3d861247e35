"""The flow's progress reads while the store is down: no records this time, never a
failed flow (its shards decide how the job ends)."""

from __future__ import annotations

import botocore.exceptions
import pytest

from tokenmill.flows import progress
from tokenmill.pipelines import output as out


class _Spec:
    output, storage_options = "s3://bucket/job/out", {}


class _Plan:
    spec = _Spec()


@pytest.mark.parametrize(
    "error",
    [
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1/bucket"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
    ids=["botocore", "oserror"],
)
def test_a_store_that_cannot_be_read_gives_no_records(monkeypatch, error):
    def down(*args, **kwargs):
        raise error

    monkeypatch.setattr(out, "read_progress", down)
    assert progress.read_records(_Plan()) == {}


def test_another_error_is_not_taken_for_the_store(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("shard_id")

    monkeypatch.setattr(out, "read_progress", broken)
    with pytest.raises(KeyError, match="shard_id"):
        progress.read_records(_Plan())
