"""Sources and sinks against a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import s3fs

from tokenmill.connectors import (
    SourceError,
    append_to_dataset,
    list_parts,
    open_source,
    read_json,
    read_parts,
    write_json_atomic,
    write_part,
)
from tokenmill.connectors import sink as sink_module

pytestmark = pytest.mark.integration

TABLE = pa.table({"id": list(range(6)), "prompt": [f"q{i}" for i in range(6)]})


def _put(s3, url: str, data: bytes) -> None:
    s3fs.S3FileSystem(**s3.storage_options).pipe(url, data)


def _parquet(table=TABLE) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def test_read_parquet_jsonl_csv(s3, s3_prefix):
    jsonl = "".join(json.dumps(r) + "\n" for r in TABLE.to_pylist()).encode()
    csv = io.BytesIO()
    pa_csv.write_csv(TABLE, csv)
    _put(s3, f"{s3_prefix}/in/data.parquet", _parquet())
    _put(s3, f"{s3_prefix}/in/data.jsonl.gz", gzip.compress(jsonl))
    _put(s3, f"{s3_prefix}/in/data.csv", csv.getvalue())

    for name, fmt in [("data.parquet", "parquet"), ("data.jsonl.gz", "jsonl"), ("data.csv", "csv")]:
        source = open_source(f"{s3_prefix}/in/{name}", storage_options=s3.storage_options)
        assert source.format == fmt
        assert source.files == [f"{s3_prefix}/in/{name}"]
        assert source.to_table().to_pylist() == TABLE.to_pylist()


def test_hive_directory_on_s3_streams_batches(s3, s3_prefix):
    _put(s3, f"{s3_prefix}/ds/split=train/p0.parquet", _parquet())
    _put(s3, f"{s3_prefix}/ds/split=test/p0.parquet", _parquet(TABLE.slice(0, 2)))
    _put(s3, f"{s3_prefix}/ds/_SUCCESS", b"")

    source = open_source(f"{s3_prefix}/ds", storage_options=s3.storage_options, batch_size=4)

    assert source.num_rows == 8
    assert [b.num_rows for b in source.iter_batches()] == [2, 4, 2]
    assert source.to_table().column("split").to_pylist() == ["test"] * 2 + ["train"] * 6


def test_errors_name_the_url_and_never_the_credentials(s3, s3_prefix):
    options = {**s3.storage_options, "secret": "sEcReT-do-not-leak"}
    _put(s3, f"{s3_prefix}/bad.parquet", b"garbage" * 10)

    for url, problem in [
        (f"{s3_prefix}/missing.parquet", "path does not exist"),
        (f"{s3_prefix}/bad.parquet", "not a readable parquet file"),
        (f"{s3_prefix}/empty/", "path does not exist"),
    ]:
        with pytest.raises(SourceError) as info:
            open_source(url, storage_options=options)
        message = str(info.value)
        assert message.startswith(url.rstrip("/")) and problem in message
        assert "sEcReT" not in message and "testing" not in message
        assert "sEcReT" not in repr(info.value.__cause__)


def test_parts_ledger_and_dataset_on_s3(s3, s3_prefix):
    options = s3.storage_options
    out = f"{s3_prefix}/results"

    url = write_part(TABLE, out, "part-00000", storage_options=options)
    write_part(TABLE.slice(0, 1), out, "part-00001", format="jsonl", storage_options=options)
    write_json_atomic(f"{out}/ledger.json", {"rows_ok": 7}, storage_options=options)
    append_to_dataset(f"{s3_prefix}/ledger", pa.table({"job": ["a"]}), storage_options=options)
    append_to_dataset(f"{s3_prefix}/ledger", pa.table({"job": ["b"], "n": [1]}), options)

    assert url == f"{out}/part-00000.parquet"
    assert list_parts(out, options) == [url, f"{out}/part-00001.jsonl"]
    assert read_parts(out, options).num_rows == 7
    assert read_json(f"{out}/ledger.json", options) == {"rows_ok": 7}
    assert read_parts(f"{s3_prefix}/ledger", options).to_pylist() == [
        {"job": "a", "n": None},
        {"job": "b", "n": 1},
    ]
    with pytest.raises(FileExistsError):
        write_part(TABLE, out, "part-00000", storage_options=options)


def test_crash_before_upload_leaves_nothing_on_s3(s3, s3_prefix, monkeypatch):
    def crash(table, fmt, f):
        f.write(b"PAR1 partial")
        raise RuntimeError("killed")

    monkeypatch.setattr(sink_module, "_serialize", crash)
    with pytest.raises(RuntimeError):
        write_part(TABLE, f"{s3_prefix}/results", "part-00000", storage_options=s3.storage_options)

    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.invalidate_cache()
    assert fs.find(s3_prefix) == []
    assert list_parts(f"{s3_prefix}/results", s3.storage_options) == []


def test_polars_reads_what_the_sink_wrote(s3, s3_prefix):
    pl = pytest.importorskip("polars")
    write_part(TABLE, f"{s3_prefix}/pl", "part-00000", storage_options=s3.storage_options)

    frame = pl.read_parquet(
        f"{s3_prefix}/pl/part-00000.parquet", storage_options=s3.polars_storage_options
    )

    assert frame["id"].to_list() == list(range(6))
