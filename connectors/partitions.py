"""A Source split into partitions that workers read apart: rows in the Source's order.

A partition is one file, a run of one Parquet file's row groups, or a byte range of an
uncompressed UTF-8 JSON Lines file. Byte ranges follow one rule: a line belongs to the
range that holds its first byte. A range [start, stop) therefore reads from the first
line start at or after `start` to the first line start at or after `stop` (the line
crossing `stop` is read whole); the ranges of a file tile it, each line read once.

What is read whole, one partition per file, and why:
- delimited text (CSV, TSV): a quoted field may hold newlines, so a newline is no
  record boundary and a byte offset cannot be resolved to one without reading from the
  file's start;
- compressed files: a stream cannot be entered at an offset;
- other encodings than UTF-8: their newline need not be one byte;
- JSON arrays and OpenAI batch files (the latter are never planned spread).

A partition's rows are numbered in the Source's order once the rows before it are
known: Parquet footers give them, text partitions are counted first (`count_partition`:
JSON Lines ranges by their non-blank lines, no parsing; whole files by reading them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.connectors.batches import BlankTally, conform, rechunk
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.formats import compression_of, get_reader
from tokenmill.connectors.fs import display
from tokenmill.connectors.lines import iter_lines
from tokenmill.connectors.parquet_reader import decode_text
from tokenmill.connectors.source import PARSE_ERRORS, raise_source_error
from tokenmill.connectors.store_retries import store_operation

# A JSON Lines range is at least this long: fewer, larger ranges cost fewer tasks, and
# the counting pass reads a range in one go.
MIN_RANGE_BYTES = 8 << 20

_SCAN_BYTES = 1 << 16  # read while looking for the newline that ends a line


@dataclass(frozen=True)
class Partition:
    """Part of one file of a Source; `row_groups` and `byte_range` are exclusive."""

    file: int  # the file's position in `Source.files`
    row_groups: tuple[int, int] | None = None  # Parquet: [first, last) row group
    byte_range: tuple[int, int] | None = None  # JSON Lines: [start, stop) bytes
    num_rows: int | None = None  # known from a Parquet footer without reading


@dataclass(frozen=True)
class PartitionCount:
    """What a partition holds: its rows, the blank records skipped, its lines (all of
    them, blank ones too: the line numbers before the next range of its file)."""

    rows: int
    blank: int
    lines: int = 0


def split_source(source, num_parts: int, *, min_range_bytes: int = MIN_RANGE_BYTES):
    """The Source's partitions in its row order, about `num_parts` of them or more (one
    per file at least).

    Returns:
        (partitions, why): `why` names what is read whole, file by file (None when
        every file can be split).
    """
    fs, paths, options = source._fs, source._data.paths, source._options
    whole = _whole_reason(source)
    partitions: list[Partition] = []
    if source.format == "parquet":
        for number, path in enumerate(paths):
            partitions += _row_group_runs(fs, path, number, num_parts)
        return partitions, None
    if whole is not None:
        return [Partition(number) for number in range(len(paths))], whole
    sizes = [fs.size(path) for path in paths]
    share = max(min_range_bytes, -(-sum(sizes) // max(num_parts, 1)))
    for number, size in enumerate(sizes):
        if compression_of(paths[number]) is not None or not options.decoding.is_utf8:
            partitions.append(Partition(number))
            continue
        ranges = max(1, -(-size // share))
        cuts = [size * k // ranges for k in range(ranges + 1)]
        partitions += [Partition(number, byte_range=(a, b)) for a, b in zip(cuts, cuts[1:])]
    return partitions, None


def _whole_reason(source) -> str | None:
    if source.format in ("csv", "tsv"):
        return "delimited text may quote newlines inside a field, so each file is read whole"
    if source.format != "jsonl":
        return f"{source.format} files are read whole"
    return None


def _row_group_runs(fs, path: str, number: int, num_parts: int) -> list[Partition]:
    """One file's row groups in about `num_parts` runs of similar row counts."""
    with fs.open(path, "rb") as f:
        meta = pq.ParquetFile(f).metadata
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if not rows:
        return [Partition(number, row_groups=(0, 0), num_rows=0)]
    share = max(1, -(-sum(rows) // max(num_parts, 1)))
    runs, first, taken = [], 0, 0
    for group, count in enumerate(rows):
        taken += count
        if taken >= share or group == len(rows) - 1:
            runs.append(Partition(number, row_groups=(first, group + 1), num_rows=taken))
            first, taken = group + 1, 0
    return runs


def count_partition(source, partition: Partition) -> PartitionCount:
    """A partition's rows, blank records and lines, as `iter_partition` will read them."""
    if partition.num_rows is not None:
        return PartitionCount(partition.num_rows, 0)
    if partition.byte_range is None:
        blanks = BlankTally()
        rows = sum(b.num_rows for b in _file_batches(source, partition, 0, blanks))
        return PartitionCount(rows, blanks.take_all())
    rows = blank = 0

    def on_blank(_: int) -> None:
        nonlocal blank
        blank += 1

    with _open_range(source, partition) as stream:
        for _ in iter_lines(stream, on_blank=on_blank):
            rows += 1
    # every line of the range is a row or a blank one (a last line without a newline too)
    return PartitionCount(rows, blank, rows + blank)


def iter_partition(
    source, partition: Partition, *, first_line: int = 0, blanks: BlankTally | None = None
) -> Iterator[pa.RecordBatch]:
    """A partition's rows as `Source.iter_batches` yields them (the Source's schema, at
    most its batch size a batch); `first_line`: the lines of the file before it, so a
    bad line's message gives its line in the file."""
    yield from _file_batches(source, partition, first_line, blanks)


def _file_batches(
    source, partition: Partition, first_line: int, blanks: BlankTally | None
) -> Iterator[pa.RecordBatch]:
    fs, path = source._fs, source._data.paths[partition.file]
    constants = source._data.partitions[partition.file]
    name = display(fs, path)
    reader = get_reader(source.format)
    options, schema = source._options, source._read_schema
    blanks = blanks if blanks is not None else BlankTally()
    try:
        with store_operation("reading", name):
            if partition.row_groups is not None:
                batches = _row_group_batches(fs, path, partition, schema, name, options)
            elif partition.byte_range is not None:
                batches = _range_batches(source, partition, first_line, schema, name, blanks)
            else:
                batches = reader.iter_batches(
                    fs, path, schema, name=name, options=options, blanks=blanks
                )
            for batch in rechunk(batches, source.batch_size):
                if batch.num_rows:
                    yield conform(batch, source.schema, constants)
    except PARSE_ERRORS as e:
        raise_source_error(name, source.format, e)


def _row_group_batches(fs, path, partition, schema, name, options):
    first, last = partition.row_groups
    with fs.open(path, "rb") as f:
        parquet_file = pq.ParquetFile(f)
        meta = parquet_file.metadata
        start = sum(meta.row_group(g).num_rows for g in range(first))  # row index in the file
        present = set(parquet_file.schema_arrow.names)
        columns = [c for c in schema.names if c in present]
        if first == last:
            return
        for batch in parquet_file.iter_batches(
            batch_size=options.batch_size, columns=columns, row_groups=range(first, last)
        ):
            yield decode_text(batch, start, name=name, options=options)
            start += batch.num_rows


def _range_batches(source, partition, first_line, schema, name, blanks):
    reader = get_reader(source.format)
    with _open_range(source, partition) as stream:
        yield from reader.batches_of(
            stream, schema, name=name, options=source._options, blanks=blanks, first_line=first_line
        )


class _Range:
    """`end - begin` bytes of a file from `begin`."""

    def __init__(self, raw, begin: int, end: int):
        self._raw, self._left = raw, end - begin
        raw.seek(begin)

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        data = self._raw.read(self._left if size < 0 else min(size, self._left))
        self._left -= len(data)
        return data


@contextmanager
def _open_range(source, partition: Partition) -> Iterator[Any]:
    """A JSON Lines range's lines as a stream: at the file's start as `open_decoded`
    gives them (a byte order mark skipped), after it as they are (a line may begin
    with U+FEFF, and UTF-8 passes through unchanged)."""
    fs, path = source._fs, source._data.paths[partition.file]
    start, stop = partition.byte_range
    with fs.open(path, "rb") as raw:
        begin, end = _line_start(raw, start), _line_start(raw, stop)
        stream = _Range(raw, begin, end)
        yield open_decoded(stream, source._options.decoding) if begin == 0 else stream


def _line_start(raw, offset: int) -> int:
    """The first line start at or after `offset` (the file's size if none)."""
    if offset == 0:
        return 0
    raw.seek(offset - 1)
    position = offset - 1
    while True:
        data = raw.read(_SCAN_BYTES)
        if not data:
            return position
        at = data.find(b"\n")
        if at >= 0:
            return position + at + 1
        position += len(data)
