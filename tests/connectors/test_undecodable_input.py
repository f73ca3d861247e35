"""Bytes that are not text cost only their own row, in every format: an error row naming
the file and the line (or row index), or with on_decode_error="replace" U+FFFD and a
flag. Other encodings are read with `encoding=`."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs

from tokenmill.connectors import ERROR_COLUMN, REPLACED_COLUMN, SourceError, open_source

BAD = b"b\xffd"  # 0xff never occurs in UTF-8


def _rows(path, **kwargs) -> list[dict]:
    return open_source(str(path), on_bad_line="skip_row", **kwargs).to_table().to_pylist()


def _jsonl(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in lines)


GOOD_1 = b'{"id": "a", "prompt": "first"}'
GOOD_2 = b'{"id": "c", "prompt": "third"}'


@pytest.mark.parametrize(
    "bad_line",
    [
        b'{"id": "b", "prompt": "' + BAD + b'"}',  # in the prompt
        b'{"id": "' + BAD + b'", "prompt": "second"}',  # in the id column
        b'{"id": "b", "messages": [{"role": "user", "content": "' + BAD + b'"}]}',
    ],
    ids=["prompt", "id", "messages"],
)
def test_jsonl_line_that_is_not_utf8_is_an_error_row_naming_it(tmp_path, bad_line):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl(GOOD_1, bad_line, GOOD_2))

    rows = _rows(path)

    assert [(r["id"], r["prompt"]) for r in rows] == [("a", "first"), (None, None), ("c", "third")]
    offset = bad_line.index(b"\xff")
    assert (
        rows[1][ERROR_COLUMN] == f"{path}: line 2: not valid UTF-8 (byte 0xff at offset {offset})"
    )
    assert rows[0][ERROR_COLUMN] is None and rows[2][ERROR_COLUMN] is None
    with pytest.raises(SourceError) as info:
        open_source(str(path)).to_table()
    assert str(info.value) == f"{path}: line 2: not valid UTF-8 (byte 0xff at offset {offset})"


@pytest.mark.parametrize("where", ["prompt", "id"])
def test_csv_row_that_is_not_utf8_is_an_error_row_and_the_column_stays_text(tmp_path, where):
    path = tmp_path / "d.csv"
    bad = b"2," + BAD if where == "prompt" else BAD + b",second"
    path.write_bytes(b"id,prompt\n1,first\n" + bad + b"\n3,third\n")

    source = open_source(str(path), on_bad_line="skip_row")
    rows = source.to_table().to_pylist()

    assert source.schema.field("prompt").type == pa.string()
    assert [r["prompt"] for r in rows] == ["first", None, "third"]
    offset = bad.index(b"\xff")
    assert (
        rows[1][ERROR_COLUMN] == f"{path}: line 3: not valid UTF-8 (byte 0xff at offset {offset})"
    )


def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_text(tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + GOOD_1 + b"\r\n" + GOOD_2 + b"\r\n")
    csv = tmp_path / "bom.csv"
    csv.write_bytes(b'\xef\xbb\xbfid,prompt\r\na,first\r\nc,"third\r\nline"\r\n')

    assert [(r["id"], r["prompt"]) for r in _rows(jsonl)] == [("a", "first"), ("c", "third")]
    assert [(r["id"], r["prompt"]) for r in _rows(csv)] == [("a", "first"), ("c", "third\r\nline")]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_gzip_compressed_input_with_a_bad_row(tmp_path, fmt):
    path = tmp_path / f"d.{fmt}.gz"
    if fmt == "jsonl":
        body = _jsonl(GOOD_1, b'{"id": "b", "prompt": "' + BAD + b'"}', GOOD_2)
    else:
        body = b"id,prompt\na,first\nb," + BAD + b"\nc,third\n"
    path.write_bytes(gzip.compress(body))

    rows = _rows(path)

    assert [r["id"] for r in rows] == ["a", None, "c"]
    assert rows[1][ERROR_COLUMN].startswith(f"{path}: line {2 if fmt == 'jsonl' else 3}: not valid")


def test_a_bad_byte_at_a_read_boundary_costs_only_its_line(tmp_path):
    # Lines of 1000 bytes read 1 MiB at a time: the first read ends inside a two-byte
    # character, the second just before the bad byte.
    prompt = "x" * 185 + "é" * 400
    lines = [json.dumps({"prompt": prompt}, ensure_ascii=False).encode() for _ in range(2200)]
    assert {len(line) for line in lines} == {999}
    assert lines[1048][(1 << 20) - 1048 * 1000 - 1] == 0xC3  # a character's first byte
    bad = bytearray(lines[2097])
    bad[(2 << 20) - 2097 * 1000] = 0xFF
    lines[2097] = bytes(bad)
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl(*lines))

    errors = [(i, e) for i, e in enumerate(r[ERROR_COLUMN] for r in _rows(path)) if e]

    assert errors == [(2097, f"{path}: line 2098: not valid UTF-8 (byte 0xff at offset 152)")]


def test_other_encodings_are_read_with_encoding(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("id,prompt\n1,café\n2,naïve\n".encode("latin-1"))
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes(
        "".join(json.dumps({"p": s}) + "\n" for s in ["héllo", "wörld"]).encode("utf-16")
    )

    assert [r["prompt"] for r in _rows(latin, encoding="latin-1")] == ["café", "naïve"]
    assert [r["p"] for r in _rows(utf16, encoding="utf-16")] == ["héllo", "wörld"]
    # Read as UTF-8 they are not text: each line is an error row, the file fails nothing.
    assert [r[ERROR_COLUMN] is not None for r in _rows(latin)] == [True, True]


def test_a_unit_that_does_not_decode_in_another_encoding_names_its_line(tmp_path):
    path = tmp_path / "d.csv"
    # A lone UTF-16 surrogate (0xd800) in the second data row.
    body = "id,prompt\n1,first\n2,X\n3,third\n".encode("utf-16-le")
    body = body.replace("X".encode("utf-16-le"), b"\x00\xd8")
    path.write_bytes(body)

    rows = _rows(path, encoding="utf-16-le")

    assert [r["prompt"] for r in rows] == ["first", None, "third"]
    assert rows[1][ERROR_COLUMN] == f"{path}: line 3: not valid utf-16-le"
    replaced = _rows(path, encoding="utf-16-le", on_decode_error="replace")
    assert [r["prompt"] for r in replaced] == ["first", "\ufffd", "third"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_replace_substitutes_u_fffd_and_flags_the_row(tmp_path, fmt):
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(_jsonl(GOOD_1, b'{"id": "b", "prompt": "' + BAD + b'"}', GOOD_2))
    else:
        path.write_bytes(b"id,prompt\na,first\nb," + BAD + b"\nc,third\n")

    source = open_source(str(path), on_bad_line="skip_row", on_decode_error="replace")
    rows = source.to_table().to_pylist()

    assert source.schema.field(REPLACED_COLUMN).type == pa.bool_()
    assert [(r["id"], r["prompt"], r[REPLACED_COLUMN]) for r in rows] == [
        ("a", "first", False),
        ("b", "b\ufffdd", True),
        ("c", "third", False),
    ]
    assert all(r[ERROR_COLUMN] is None for r in rows)


def test_openai_batch_line_that_is_not_utf8(tmp_path):
    def request(custom_id: bytes, content: bytes) -> bytes:
        body = b'{"messages": [{"role": "user", "content": "' + content + b'"}]}'
        return (
            b'{"custom_id": "' + custom_id + b'", "method": "POST", '
            b'"url": "/v1/chat/completions", "body": ' + body + b"}"
        )

    path = tmp_path / "batch.jsonl"
    path.write_bytes(_jsonl(request(b"r1", b"hi"), request(b"r2", BAD), request(b"r3", b"yo")))

    rows = _rows(path, format="openai-batch")

    assert [r["custom_id"] for r in rows] == ["r1", None, "r3"]
    assert rows[1][ERROR_COLUMN].startswith(f"{path}: line 2: not valid UTF-8 (byte 0xff")
    replaced = _rows(path, format="openai-batch", on_decode_error="replace")
    assert replaced[1]["messages"] == [
        {
            "role": "user",
            "content": "b\ufffdd",
            "tool_calls": None,
            "tool_call_id": None,
            "parts": None,
        }
    ]
    assert [r[REPLACED_COLUMN] for r in replaced] == [False, True, False]


def test_json_escapes_of_lone_surrogates_are_bad_values_not_a_failed_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl(GOOD_1, b'{"id": "b", "prompt": "x\\ud800y"}', GOOD_2))

    rows = _rows(path, text_columns=["prompt"])

    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert rows[1][ERROR_COLUMN] == (
        f"{path}: line 2: column 'prompt': text with an unpaired surrogate escape such as "
        "\\ud800 (not valid Unicode)"
    )


def test_parquet_binary_text_columns_are_decoded_value_by_value(tmp_path):
    path = tmp_path / "d.parquet"
    prompts = pa.array([b"first", BAD, "café".encode("latin-1"), None], pa.binary())
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "prompt": prompts}), path)

    source = open_source(str(path), on_bad_line="skip_row", decode_columns=["prompt"])
    rows = source.to_table().to_pylist()

    assert source.schema.field("prompt").type == pa.string()
    assert [(r["id"], r["prompt"]) for r in rows] == [
        ("a", "first"),
        ("b", None),  # the row keeps its id for its error row
        ("c", None),
        ("d", None),
    ]
    assert rows[1][ERROR_COLUMN] == (
        f"{path}: row index 1: column 'prompt': not valid UTF-8 (byte 0xff at offset 1)"
    )
    assert rows[2][ERROR_COLUMN].startswith(f"{path}: row index 2: column 'prompt'")
    latin = _rows(path, decode_columns=["prompt"], encoding="latin-1")
    assert [r["prompt"] for r in latin] == ["first", "b\xffd", "café", None]
    # Columns the job does not read as text keep their bytes.
    assert open_source(str(path)).schema.field("prompt").type == pa.binary()


def test_unknown_encodings_are_refused_before_reading(tmp_path):
    with pytest.raises(ValueError, match="'klingon' is not an encoding"):
        open_source(str(tmp_path / "none.jsonl"), encoding="klingon")
    with pytest.raises(ValueError, match="'base64' is not a text encoding"):
        open_source(str(tmp_path / "none.jsonl"), encoding="base64")
    with pytest.raises(ValueError, match="on_decode_error must be one of error-row, replace"):
        open_source(str(tmp_path / "none.jsonl"), on_decode_error="ignore")


@pytest.mark.integration
def test_bad_rows_on_an_object_store(s3, s3_prefix):
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe(f"{s3_prefix}/in/a.csv", b"id,prompt\na,first\nb," + BAD + b"\nc,third\n")
    fs.pipe(f"{s3_prefix}/in/b.jsonl.gz", gzip.compress(_jsonl(GOOD_1, BAD, GOOD_2)))

    for name, line in [("a.csv", 3), ("b.jsonl.gz", 2)]:
        url = f"{s3_prefix}/in/{name}"
        rows = open_source(url, storage_options=s3.storage_options, on_bad_line="skip_row")
        table = rows.to_table().to_pylist()
        assert [r["id"] for r in table] == ["a", None, "c"]
        assert table[1][ERROR_COLUMN].startswith(f"{url}: line {line}: not valid UTF-8")
