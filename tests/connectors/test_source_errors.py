"""Bad input fails in open_source, before any row is read, with a message naming the file."""

from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import SourceError, open_source, redact_options, redact_url


def _parquet_bytes(num_rows: int = 100) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(num_rows))}), buffer)
    return buffer.getvalue()


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(SourceError, match=f"{missing}: path does not exist"):
        open_source(str(missing))


def test_empty_directory(tmp_path):
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(SourceError, match=f"{tmp_path}: no data files in this directory"):
        open_source(str(tmp_path))


def test_glob_without_matches(tmp_path):
    with pytest.raises(SourceError, match="no data files match"):
        open_source(str(tmp_path / "*.parquet"))


def test_truncated_parquet(tmp_path):
    path = tmp_path / "cut.parquet"
    path.write_bytes(_parquet_bytes()[:-40])
    with pytest.raises(SourceError, match=f"{path}: not a readable parquet file"):
        open_source(str(path))


def test_garbage_parquet_in_a_directory_names_that_file(tmp_path):
    (tmp_path / "a.parquet").write_bytes(_parquet_bytes())
    (tmp_path / "b.parquet").write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(SourceError, match=f"{tmp_path / 'b.parquet'}: not a readable parquet"):
        open_source(str(tmp_path))


def test_empty_parquet_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    with pytest.raises(SourceError, match="empty.parquet: not a readable parquet file"):
        open_source(str(path))


def test_missing_column_lists_available(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_bytes(_parquet_bytes())
    with pytest.raises(SourceError) as info:
        open_source(str(path), columns=["id", "prompt"])
    assert str(info.value) == f"{path}: column(s) 'prompt' not found; available columns: id"


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3,,}\n')
    with pytest.raises(SourceError) as info:
        open_source(str(path))
    assert str(info.value).startswith(f"{path}: line 4: invalid JSON")


def test_invalid_json_beyond_the_head_fails_full_validation(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"a": i}) for i in range(120_000)] + ["not json"]
    path.write_text("\n".join(lines) + "\n")

    source = open_source(str(path))  # the 1 MiB head is fine
    with pytest.raises(SourceError, match=f"{path}: line 120001: invalid JSON"):
        list(source.iter_batches())
    with pytest.raises(SourceError, match="line 120001"):
        open_source(str(path), validate="full")


def test_a_json_array_in_a_jsonl_file_gets_a_hint(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('[{"a": 1}, {"a": 2}]')
    with pytest.raises(
        SourceError, match="line 1: expected a JSON object, got list .*--format json"
    ):
        open_source(str(path))


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(b"\x1f\x8b" + b"garbage" * 20)
    with pytest.raises(SourceError, match="data.jsonl.gz: not a readable jsonl file"):
        open_source(str(path))


def test_truncated_gzip_found_by_full_validation(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    body = "".join(json.dumps({"a": i}) + "\n" for i in range(50_000)).encode()
    path.write_bytes(gzip.compress(body)[:-100])
    with pytest.raises(SourceError, match="data.jsonl.gz: not a readable jsonl file"):
        open_source(str(path), validate="full")


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_bytes(b"PK")
    with pytest.raises(SourceError, match="data.xlsx: unknown format from the file name"):
        open_source(str(path))


def test_unknown_format_name(tmp_path):
    with pytest.raises(SourceError, match="unknown format 'avro'"):
        open_source(str(tmp_path), format="avro")


def test_mixed_formats_in_a_directory(tmp_path):
    (tmp_path / "a.parquet").write_bytes(_parquet_bytes())
    (tmp_path / "b.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(SourceError, match="mixed formats"):
        open_source(str(tmp_path))


def test_csv_type_conflict_message_has_no_cell_value(tmp_path):
    path = tmp_path / "data.csv"
    rows = "".join(f"{i},x\n" for i in range(200_000))
    path.write_text("a,b\n" + rows + "SECRET-CELL,x\n")
    with pytest.raises(SourceError) as info:
        open_source(str(path), validate="full")
    assert str(info.value) == f"{path}: line 200002: column 'a': value does not fit type int64"
    assert "SECRET-CELL" not in str(info.value)
    assert info.value.__cause__ is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_bad_line": "ignore"}, "on_bad_line"),
        ({"batch_size": 0}, "batch_size"),
        ({"columns": "id"}, "columns"),
        ({"columns": ["id", "id"]}, "repeat"),
        ({"validate": "deep"}, "validate"),
        ({"format": "parquet", "schema": pa.schema([("a", pa.int64())])}, "schema="),
    ],
)
def test_bad_options_raise_before_any_io(kwargs, message):
    with pytest.raises(ValueError, match=message):
        open_source("s3://no-such-bucket-anywhere/x.parquet", **kwargs)


def test_unknown_protocol():
    with pytest.raises(SourceError, match="nosuchproto://b/x.parquet"):
        open_source("nosuchproto://b/x.parquet")


def test_redaction_of_urls_and_options():
    assert redact_url("https://user:pw@host/x.jsonl?X-Amz-Signature=abc") == (
        "https://user:***@host/x.jsonl?<redacted>"
    )
    assert redact_url("s3://bucket/key.parquet") == "s3://bucket/key.parquet"
    assert redact_url("/local/path") == "/local/path"
    assert redact_options({"key": "AKIA", "secret": "s", "endpoint_url": "http://e"}) == {
        "key": "***",
        "secret": "***",
        "endpoint_url": "http://e",
    }


def test_protocol_without_its_package_says_so():
    with pytest.raises(SourceError, match="gs://bucket/x.parquet: this protocol needs an extra"):
        open_source("gs://bucket/x.parquet", storage_options={"token": "SECRET"})
