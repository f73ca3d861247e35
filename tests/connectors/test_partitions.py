"""A Source read partition by partition gives its rows as read whole: the same table
(bad lines' messages with their line in the file), the same row and blank counts;
byte ranges tile a JSON Lines file line by line wherever the cuts fall."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import open_source
from tokenmill.connectors.batches import BlankTally, ReadCounts
from tokenmill.connectors.partitions import (
    Partition,
    count_partition,
    iter_partition,
    split_source,
)


def _lines(num_rows: int) -> list[str]:
    """Rows of varied length; a blank line every 17th, one line that is not JSON."""
    lines = []
    for i in range(num_rows):
        if i % 17 == 0:
            lines.append("   ")
        elif i == 50:
            lines.append('{"k": "broken')
        else:
            lines.append(json.dumps({"k": f"k{i}", "p": "x" * (i % 13)}))
    return lines


def _whole(source) -> tuple[pa.Table, ReadCounts]:
    counts = ReadCounts()
    batches = list(source.iter_batches(counts=counts))
    return pa.Table.from_batches(batches, schema=source.schema), counts


def _by_partition(source, partitions: list[Partition]) -> tuple[pa.Table, ReadCounts]:
    """What the parts read, numbered as spread planning numbers them (lines per file)."""
    counts = ReadCounts()
    batches, first_line, file = [], 0, None
    for partition in partitions:
        if partition.file != file:
            first_line, file = 0, partition.file
        counted = count_partition(source, partition)
        blanks = BlankTally()
        read = list(iter_partition(source, partition, first_line=first_line, blanks=blanks))
        assert sum(b.num_rows for b in read) == counted.rows
        assert blanks.take_all() == counted.blank
        batches += read
        counts.rows += counted.rows
        counts.blank += counted.blank
        first_line += counted.lines
    return pa.Table.from_batches(batches, schema=source.schema), counts


@pytest.mark.parametrize("ending", ["\n", "", "\n  "])  # newline, none, whitespace after
def test_jsonl_ranges_tile_the_file_wherever_they_are_cut(tmp_path, ending):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_lines(200)) + ending)
    source = open_source(str(path), on_bad_line="skip_row")
    whole, counts = _whole(source)
    size = path.stat().st_size
    assert whole.num_rows == 188 and counts.blank == 12 + (ending == "\n  ")
    errors = whole.column("__error__").drop_null().to_pylist()
    assert len(errors) == 1 and "line 51: invalid JSON" in errors[0]
    for num_parts in (2, 3, 7, 40):
        partitions, why = split_source(source, num_parts, min_range_bytes=1)
        assert why is None and len(partitions) == num_parts
        assert [p.byte_range for p in partitions][0][0] == 0
        assert partitions[-1].byte_range[1] == size
        table, read = _by_partition(source, partitions)
        assert table.equals(whole) and read == counts
    # cuts on every byte of one stretch: at a newline, just after it, mid-line
    for cut in range(300, 420):
        partitions = [Partition(0, byte_range=(0, cut)), Partition(0, byte_range=(cut, size))]
        table, read = _by_partition(source, partitions)
        assert table.equals(whole) and read == counts


def test_a_byte_order_mark_is_skipped_at_the_start_only(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = [json.dumps({"k": f"k{i}", "p": "é" * i}) for i in range(30)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode() + b"\n")
    source = open_source(str(path), on_bad_line="skip_row")
    whole, counts = _whole(source)
    assert whole.column("k").to_pylist() == [f"k{i}" for i in range(30)]
    partitions, _ = split_source(source, 4, min_range_bytes=1)
    table, read = _by_partition(source, partitions)
    assert len(partitions) == 4 and table.equals(whole) and read == counts


def test_compressed_and_delimited_files_are_read_whole_per_file(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    lines = _lines(60)
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[:30]) + "\n").encode()))
    (folder / "b.jsonl").write_text("\n".join(lines[30:]) + "\n")
    source = open_source(str(folder), on_bad_line="skip_row")
    partitions, why = split_source(source, 4, min_range_bytes=1)
    assert why is None
    assert partitions[0] == Partition(0)  # the gzipped file: no offset into a stream
    assert [p.file for p in partitions[1:]] == [1] * 4
    table, read = _by_partition(source, partitions)
    assert (table, read) == _whole(source)

    csv_folder = tmp_path / "csv"
    csv_folder.mkdir()
    (csv_folder / "a.csv").write_text('k,p\nk0,"two\nlines"\nk1,x\n')
    (csv_folder / "b.csv").write_text("k,p\nk2,y\n\nk3,z,extra\n")
    source = open_source(str(csv_folder), on_bad_line="skip_row")
    partitions, why = split_source(source, 4, min_range_bytes=1)
    assert partitions == [Partition(0), Partition(1)]
    assert "quote newlines" in why
    table, read = _by_partition(source, partitions)
    whole, counts = _whole(source)
    assert table.equals(whole) and read == counts
    assert whole.column("k").to_pylist()[:3] == ["k0", "k1", "k2"]


def test_parquet_row_groups_are_split_without_reading_rows(tmp_path):
    table = pa.table({"k": [f"k{i}" for i in range(50)], "p": [str(i) for i in range(50)]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)  # 8 groups: 7 x 7 + 1
    pq.write_table(table.slice(0, 3), tmp_path / "b.parquet")
    source = open_source(str(tmp_path), on_bad_line="skip_row")
    partitions, _ = split_source(source, 3)
    assert [(p.file, p.row_groups, p.num_rows) for p in partitions] == [
        (0, (0, 3), 21),
        (0, (3, 6), 21),
        (0, (6, 8), 8),
        (1, (0, 1), 3),
    ]
    read, counts = _by_partition(source, partitions)
    assert (read, counts) == _whole(source)
