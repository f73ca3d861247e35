"""Duplicates found in hash buckets on the workers: the driver keeps the few sources
later windows copy from, not a digest per distinct row.

`dedupe.py` decides, in full; this finds the same copies without one process seeing
every row. Each part of a spread planning writes its candidate rows (those `dedupe.py`
rule 1 may copy: prompt tokens, deterministic params) as (digest, row index) into B
bucket files by digest, `OUTPUT/_windows/rows-<bucket>/<part>-<n>.parquet`. One task
per bucket (`bucket_copies`) groups equal digests: the smallest row index is the source
(rule 2: the first in input order), every other row a copy of it. It writes its
decisions by group of windows, `OUTPUT/_windows/copies-<group>/<bucket>.parquet`: per
copy (row, source row), and per source that a later window copies from (row, -1 - its
last copy's row), and answers with its number of copies.

The windows are cut in order (`planning.cut_window`) with a `BucketedDeduplicator`:
a window's decisions say which of its rows are copies and of which source; a source
copied from a later window has its shard remembered until its last copy's window is
cut. Where runs of windows are cut by different workers (`spread_cut.py`), a copy of a
source another worker cut is left without its shard here, and the shards of the
sources later windows copy from are handed on (`sources_for_later`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from tokenmill.connectors import list_parts, read_part, write_part
from tokenmill.pipelines import output as out
from tokenmill.pipelines.dedupe import Copy, is_deterministic, row_digest
from tokenmill.pipelines.plan import PlannedShard
from tokenmill.pipelines.tokenize import PromptRow

# Rows buffered per bucket before they are written (as in id_buckets).
FLUSH_ROWS = 65_536
# Windows whose decisions share a file: the driver reads one group's at a time.
GROUP_WINDOWS = 16

_ROWS = pa.schema([("hi", pa.uint64()), ("lo", pa.uint64()), ("row", pa.int64())])
_DECISIONS = pa.schema([("row", pa.int64()), ("source", pa.int64())])


def _rows_uri(output: str, bucket: int) -> str:
    return out.join(output, out.WINDOWS_DIR, f"rows-{bucket:05d}")


def _decisions_uri(output: str, group: int) -> str:
    return out.join(output, out.WINDOWS_DIR, f"copies-{group:06d}")


class DigestBuckets:
    """A part's candidate rows, written to `num_buckets` bucket files by digest."""

    def __init__(self, output: str, storage_options, *, part: int, num_buckets: int, params):
        self.output, self.storage_options = output, storage_options
        self.part, self.num_buckets, self.params = part, num_buckets, params
        self._buffers: list[list[tuple[bytes, int]]] = [[] for _ in range(num_buckets)]
        self._files = 0

    def add(self, rows: Sequence[PromptRow], apart: Collection[int] = ()) -> None:
        """Rows of a window, in input order (those in `apart` are never copies)."""
        for row in rows:
            if (
                row.token_ids is None
                or not is_deterministic(self.params[row.params_index])
                or row.row_index in apart
            ):
                continue
            digest = row_digest(row)
            bucket = int.from_bytes(digest[:8], "little") % self.num_buckets
            self._buffers[bucket].append((digest, row.row_index))
            if len(self._buffers[bucket]) >= FLUSH_ROWS:
                self._flush(bucket)

    def close(self) -> None:
        for bucket in range(self.num_buckets):
            if self._buffers[bucket]:
                self._flush(bucket)

    def _flush(self, bucket: int) -> None:
        pairs = self._buffers[bucket]
        keys = np.frombuffer(b"".join(d for d, _ in pairs), dtype=[("hi", "<u8"), ("lo", "<u8")])
        table = pa.table(
            [keys["hi"], keys["lo"], np.asarray([r for _, r in pairs], np.int64)], schema=_ROWS
        )
        write_part(
            table,
            _rows_uri(self.output, bucket),
            f"{self.part:05d}-{self._files:06d}",
            storage_options=self.storage_options,
            overwrite=True,
        )
        self._files += 1
        self._buffers[bucket] = []


def bucket_copies(output: str, storage_options, bucket: int, window_rows: int) -> int:
    """Decide one bucket's copies and write the decisions (a task on a worker); returns
    its number of copies."""
    urls = list_parts(_rows_uri(output, bucket), storage_options)
    if not urls:
        return 0
    frame = pl.from_arrow(pa.concat_tables([read_part(u, storage_options) for u in urls]))
    frame = frame.with_columns(pl.col("row").min().over("hi", "lo").alias("source"))
    copies = frame.filter(pl.col("row") != pl.col("source")).select("row", "source")
    if not copies.height:
        return 0
    # sources copied from a later window: (row, -1 - the last copy's row)
    window = pl.col("row") // window_rows
    later = (
        copies.filter(window != pl.col("source") // window_rows)
        .group_by("source")
        .agg(pl.col("row").max().alias("last"))
        .select(pl.col("source").alias("row"), (-1 - pl.col("last")).alias("source"))
    )
    decisions = pl.concat([copies, later]).with_columns(
        (pl.col("row") // window_rows // GROUP_WINDOWS).alias("group")
    )
    for (group,), part in decisions.group_by("group"):
        write_part(
            part.select("row", "source").to_arrow().cast(_DECISIONS),
            _decisions_uri(output, group),
            f"{bucket:05d}",
            storage_options=storage_options,
            overwrite=True,
        )
    return copies.height


class BucketedDeduplicator:
    """`dedupe.Deduplicator`'s interface (`split`, `sources_cut`, `num_copies`) over the
    decisions `bucket_copies` wrote."""

    def __init__(
        self, output: str, storage_options, *, window_rows: int, cut_elsewhere: bool = False
    ) -> None:
        """`cut_elsewhere`: earlier windows may have been cut by another process (not
        through this one), so a copy of a source there has its shard left None."""
        self.output, self.storage_options, self.window_rows = output, storage_options, window_rows
        self.cut_elsewhere = cut_elsewhere
        self.num_copies = 0
        # This window's sources that later windows copy from, with their shards (after
        # `sources_cut`).
        self.sources_for_later: dict[int, str] = {}
        self._window = -1
        self._group: int | None = None
        self._decisions: pl.DataFrame | None = None
        self._source_shards: dict[int, str] = {}  # source row -> shard, for later windows
        self._expires: dict[int, list[int]] = {}  # window -> sources whose last copy is there
        self._needed: list[int] = []
        self._pending: list[Copy] = []

    def split(self, rows: Sequence[PromptRow], apart: Collection[int] = ()) -> list[PromptRow]:
        """The rows of a window to compute; its copies are kept here (`apart`: as the
        parts were given it, so unused here)."""
        if not rows:
            return []
        window = self._window = rows[0].row_index // self.window_rows
        decided = self._window_decisions(window)
        copy_of = dict(decided.filter(pl.col("source") >= 0).iter_rows())
        later = decided.filter(pl.col("source") < 0)
        self._needed = later["row"].to_list()
        for source, last in later.iter_rows():
            self._expires.setdefault((-1 - last) // self.window_rows, []).append(source)
        keep, self._pending = [], []
        for row in rows:
            source = copy_of.get(row.row_index)
            if source is None:
                keep.append(row)
            elif source // self.window_rows == window:
                self._pending.append(Copy(row, source, None))
            elif self.cut_elsewhere:
                self._pending.append(Copy(row, source, self._source_shards.get(source)))
            else:
                self._pending.append(Copy(row, source, self._source_shards[source]))
        self.num_copies += len(self._pending)
        for source in self._expires.pop(window, []):
            self._source_shards.pop(source, None)
        return keep

    def sources_cut(self, planned: Sequence[PlannedShard]) -> list[Copy]:
        """Record where this window's sources landed; return its copies with theirs."""
        where = {r.row_index: p.shard.shard_id for p in planned for r in p.rows}
        self.sources_for_later = {source: where[source] for source in self._needed}
        self._source_shards.update(self.sources_for_later)
        copies = [
            c
            if c.source_shard is not None or c.source_row_index // self.window_rows != self._window
            else Copy(c.row, c.source_row_index, where[c.source_row_index])
            for c in self._pending
        ]
        self._needed, self._pending = [], []
        return copies

    def _window_decisions(self, window: int) -> pl.DataFrame:
        group = window // GROUP_WINDOWS
        if group != self._group:
            urls = list_parts(_decisions_uri(self.output, group), self.storage_options)
            tables = [read_part(u, self.storage_options) for u in urls]
            self._decisions = (
                pl.from_arrow(pa.concat_tables(tables)) if tables else pl.DataFrame(schema=_POLARS)
            )
            self._group = group
        start = window * self.window_rows
        return self._decisions.filter(
            pl.col("row").is_between(start, start + self.window_rows - 1)
        ).sort("row")


_POLARS = {"row": pl.Int64, "source": pl.Int64}
