"""A shard's stats written by another process are read even where this process holds an
older listing of the stats directory (a long-lived Dask worker, from an earlier flow
run or from before the other workers wrote theirs)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import s3fs

from tokenmill.connectors.fs import resolve
from tokenmill.pipelines import output as out
from tokenmill.pipelines.ledger import ShardStats


def _stats(shard_id: str) -> ShardStats:
    return ShardStats(
        shard_id, 4, "cpu", 1.5, "2026-01-01T00:00:00+00:00", "2026-01-01T00:00:02+00:00"
    )


@pytest.mark.integration
def test_stats_another_worker_wrote_are_read_past_a_cached_listing(s3):
    output = s3.url("stats-listing/out")
    stats_dir = f"{output}/{out.STATS_DIR}"
    first, second = _stats("00000-a"), _stats("00001-b")
    # This process writes its shard's stats and lists the directory: the listing is
    # cached on its filesystem instance.
    other = s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True)
    other.pipe(f"{stats_dir}/{first.shard_id}.json", json.dumps(asdict(first)).encode())
    fs, directory = resolve(stats_dir, s3.storage_options)
    assert len(fs.ls(directory)) == 1
    # Another worker (its own filesystem instance) publishes its shard's stats.
    other.pipe(f"{stats_dir}/{second.shard_id}.json", json.dumps(asdict(second)).encode())

    read = out.read_shard_stats(output, [first.shard_id, second.shard_id], s3.storage_options)
    assert read == [first, second]
