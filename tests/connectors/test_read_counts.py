"""Every record a reader sees is counted: rows handed on and blank records skipped (an
empty CSV record, a JSON Lines line of whitespace), exactly, also where `limit` stops
reading mid-batch; and a file with no record at all is known to be empty."""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import open_source
from tokenmill.connectors.batches import ReadCounts


def _read(path, **kwargs) -> tuple[list, ReadCounts]:
    limit = kwargs.pop("limit", None)
    counts = ReadCounts()
    source = open_source(str(path), batch_size=kwargs.pop("batch_size", 2), **kwargs)
    batches = list(source.iter_batches(limit=limit, counts=counts))
    rows = pa.Table.from_batches(batches, schema=source.schema).to_pylist()
    return rows, counts


def test_blank_jsonl_lines_are_counted(tmp_path):
    path = tmp_path / "in.jsonl"
    # Blank lines first, between rows (whitespace, a CRLF one) and last; the final
    # newline ends the last line and is no blank line.
    path.write_bytes(b'\n  \n{"id": 1}\n\r\n{"id": 2}\n\n\n{"id": 3}\n \t\n')

    rows, counts = _read(path)

    assert [r["id"] for r in rows] == [1, 2, 3]
    assert (counts.rows, counts.blank) == (3, 6)


def test_empty_csv_records_are_counted_as_pythons_csv_module_sees_them(tmp_path):
    data = b'id,q\r\n\r\n1,a\r\r2,"two\r\n\r\nlines"\n\n\n3,c\r\n\r\n'
    path = tmp_path / "in.csv"
    path.write_bytes(data)

    rows, counts = _read(path)

    assert [r["id"] for r in rows] == [1, 2, 3]
    assert rows[1]["q"] == "two\r\n\r\nlines"
    empty = [r for r in csv.reader(io.StringIO(data.decode(), newline="")) if not r]
    assert counts.blank == len(empty) == 5
    assert counts.rows == 3


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5])
def test_a_limit_counts_only_the_blanks_before_its_last_row(tmp_path, limit):
    path = tmp_path / "in.jsonl"
    lines = ['{"id": 0}', "", "", '{"id": 1}', '{"id": 2}', "", '{"id": 3}', "", '{"id": 4}', ""]
    path.write_text("\n".join(lines) + "\n")
    blanks_before = {1: 0, 2: 2, 3: 2, 4: 3, 5: 4}  # rows taken -> blank lines before the last

    rows, counts = _read(path, limit=limit, batch_size=3)

    assert [r["id"] for r in rows] == list(range(limit))
    assert (counts.rows, counts.blank) == (limit, blanks_before[limit])


def test_blanks_are_counted_over_every_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_bytes(b"id\n1\n\n2\n")
    (tmp_path / "d" / "b.csv").write_bytes(b"\n\nid\n3\n\n")

    rows, counts = _read(tmp_path / "d")

    assert [r["id"] for r in rows] == [1, 2, 3]
    assert (counts.rows, counts.blank) == (3, 4)


def test_openai_batch_blanks_count_around_embedding_lines(tmp_path):
    def line(custom_id, url, body):
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    embed = {"model": "m", "input": ["a", "b", "c"]}
    path = tmp_path / "batch.jsonl"
    path.write_text(
        "\n".join(
            [
                line("c1", "/v1/chat/completions", chat),
                "",
                line("e1", "/v1/embeddings", embed),  # three rows
                "",
                "",
                line("c2", "/v1/chat/completions", chat),
                "",
            ]
        )
        + "\n"
    )

    rows, counts = _read(path, format="openai-batch", batch_size=10)
    assert len(rows) == 5 and (counts.rows, counts.blank) == (5, 4)

    # Four rows end inside the embeddings line: only the blank line before it counts.
    rows, counts = _read(path, format="openai-batch", batch_size=10, limit=4)
    assert (counts.rows, counts.blank) == (4, 1)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("zero.jsonl", b""),
        ("blank.jsonl", b"\n \n\r\n"),
        ("zero.csv", b""),
        ("blank.csv", b"\r\n\r\n"),
        ("header.csv", b"id,q\r\n"),
        ("header-blanks.csv", b"id,q\r\n\r\n\n"),
        ("array.json", b" [ ] "),
        ("zero.json", b""),
    ],
)
def test_a_file_with_no_record_is_empty(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)

    rows, counts = _read(path, columns=["id", "q"])

    assert open_source(str(path), columns=["id", "q"]).is_empty
    assert rows == [] and counts.rows == 0


def test_an_empty_parquet_file_is_empty_and_a_full_one_is_not(tmp_path):
    pq.write_table(pa.table({"q": pa.array([], pa.string())}), tmp_path / "e.parquet")
    pq.write_table(pa.table({"q": ["a"]}), tmp_path / "f.parquet")
    (tmp_path / "f.jsonl").write_text('{"q": "a"}\n')

    assert open_source(str(tmp_path / "e.parquet")).is_empty
    assert not open_source(str(tmp_path / "f.parquet")).is_empty
    assert not open_source(str(tmp_path / "f.jsonl")).is_empty


def test_a_header_only_csv_still_names_its_columns(tmp_path):
    path = tmp_path / "header.csv"
    path.write_bytes(b"id,text\n")
    with pytest.raises(
        ValueError, match="column\\(s\\) 'q' not found; available columns: id, text"
    ):
        open_source(str(path), columns=["q"])
