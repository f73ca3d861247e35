"""Ids checked in hash buckets on the workers: no process holds every id.

Planning spread over workers reads the input in parts (`spread_planning.py`); no part
sees every id. Each part hands its rows' ids to an `IdBuckets` (a `reading.IdSink`):
nulls are counted there (their number and the first one's row index go back to the
driver), the other ids are written with their row indices to one of B bucket files by
their hash, `OUTPUT/_windows/ids-<bucket>/<part>-<n>.parquet`. Equal ids hash equal, so
all copies of an id land in one bucket, and one task per bucket (`bucket_duplicates`)
finds the ids that repeat there by comparing the ids themselves (a hash collision puts
two ids in one bucket, never makes them equal). A bucket answers with its number of
repeated ids and its first `ids.MAX_LISTED` of them in the order they first recur (by
the row index of their second occurrence), so the driver forms exactly the local
planner's message (`ids.duplicate_ids_message`) from B small answers.

The bucket of an id is `ids.hash_ids` modulo B: stable within one polars version, so
each part reports its hash of a probe id and planning refuses parts that disagree
(workers with another polars) rather than miss a repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from tokenmill.connectors import list_parts, read_part, write_part
from tokenmill.pipelines import output as out
from tokenmill.pipelines.ids import MAX_LISTED, hash_ids

# Ids buffered per bucket before they are written: a part's memory for its ids is
# bounded by this times the buckets, not by its rows.
FLUSH_ROWS = 65_536

PROBE_ID = "tokenmill id bucket probe"

_SCHEMA = pa.schema([("row", pa.int64()), ("id", pa.string())])


def probe_hash() -> int:
    """This process's hash of `PROBE_ID`: parts that disagree would bucket apart."""
    return int(hash_ids([PROBE_ID])[0])


@dataclass(frozen=True)
class BucketAnswer:
    """One bucket's repeated ids: how many, and the first ones in the order they recur."""

    num_duplicates: int
    first: tuple[tuple[int, str], ...]  # (row index of the second occurrence, id)


class IdBuckets:
    """A part's ids: nulls counted, the rest written to `num_buckets` bucket files."""

    def __init__(self, output: str, storage_options, *, part: int, num_buckets: int) -> None:
        self.output, self.storage_options = output, storage_options
        self.part, self.num_buckets = part, num_buckets
        self.num_nulls = 0
        self.first_null: int | None = None  # row index
        self._rows: list[list[int]] = [[] for _ in range(num_buckets)]
        self._ids: list[list[str]] = [[] for _ in range(num_buckets)]
        self._files = 0

    def add(self, ids: Sequence[str | None], first_row: int) -> None:
        """The ids of rows `first_row`, `first_row + 1`, ... (a null stops the writing:
        the job fails on it, so only nulls are counted from then on)."""
        nulls = [i for i, x in enumerate(ids) if x is None]
        if nulls and self.first_null is None:
            self.first_null = first_row + nulls[0]
        self.num_nulls += len(nulls)
        if self.num_nulls or not len(ids):
            return
        buckets = hash_ids(ids) % np.uint64(self.num_buckets)
        order = np.argsort(buckets, kind="stable")
        bounds = np.searchsorted(buckets[order], np.arange(self.num_buckets + 1, dtype=np.uint64))
        rows = (order + first_row).tolist()
        in_order = [ids[i] for i in order.tolist()]
        for bucket, (begin, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            if begin == end:
                continue
            self._rows[bucket] += rows[begin:end]
            self._ids[bucket] += in_order[begin:end]
            if len(self._rows[bucket]) >= FLUSH_ROWS:
                self._flush(bucket)

    def close(self) -> None:
        """Write what is buffered (nothing once a null was seen)."""
        for bucket in range(self.num_buckets):
            if self._rows[bucket] and not self.num_nulls:
                self._flush(bucket)

    def _flush(self, bucket: int) -> None:
        table = pa.table([self._rows[bucket], self._ids[bucket]], schema=_SCHEMA)
        write_part(
            table,
            out.id_bucket_uri(self.output, bucket),
            f"{self.part:05d}-{self._files:06d}",
            storage_options=self.storage_options,
            overwrite=True,
        )
        self._files += 1
        self._rows[bucket], self._ids[bucket] = [], []


def bucket_duplicates(output: str, storage_options, bucket: int) -> BucketAnswer:
    """The ids that repeat in one bucket (a task on a worker)."""
    urls = list_parts(out.id_bucket_uri(output, bucket), storage_options)
    if not urls:
        return BucketAnswer(0, ())
    frame = pl.from_arrow(pa.concat_tables([read_part(u, storage_options) for u in urls]))
    repeated = (
        frame.filter(pl.len().over("id") > 1)
        .group_by("id")
        .agg(pl.col("row").sort().get(1).alias("second"))
        .sort("second")
    )
    first = tuple(zip(repeated["second"].head(MAX_LISTED), repeated["id"].head(MAX_LISTED)))
    return BucketAnswer(repeated.height, first)


def merge_answers(answers: Sequence[BucketAnswer]) -> tuple[int, list[str]]:
    """(ids that repeat, the first MAX_LISTED of them in the order they first recur)."""
    first = sorted(pair for answer in answers for pair in answer.first)
    return sum(a.num_duplicates for a in answers), [rid for _, rid in first[:MAX_LISTED]]
