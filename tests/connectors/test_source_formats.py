"""open_source over every format and layout: single file, directory, glob, hive, gzip, memory."""

from __future__ import annotations

import gzip
import json

import fsspec
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source

ROWS = [{"id": i, "prompt": f"question {i}", "score": i / 2} for i in range(10)]


def _table(rows=ROWS) -> pa.Table:
    return pa.Table.from_pylist(rows)


def _write(path, fmt: str, rows=ROWS) -> None:
    if fmt == "parquet":
        pq.write_table(_table(rows), path)
    elif fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        pa_csv.write_csv(_table(rows), path)


EXT = {"parquet": "parquet", "jsonl": "jsonl", "csv": "csv"}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_single_file_reads_all_rows_with_schema_before_rows(tmp_path, fmt):
    path = tmp_path / f"data.{EXT[fmt]}"
    _write(path, fmt)

    source = open_source(str(path))

    assert source.format == fmt
    assert source.files == [str(path)]
    assert source.schema.names == ["id", "prompt", "score"]
    assert source.schema.field("id").type == pa.int64()
    assert source.schema.field("score").type == pa.float64()
    assert source.num_rows == (10 if fmt == "parquet" else None)
    assert source.to_table().to_pylist() == ROWS


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_directory_reads_sorted_files_and_skips_hidden(tmp_path, fmt):
    _write(tmp_path / f"part-1.{EXT[fmt]}", fmt, ROWS[5:])
    _write(tmp_path / f"part-0.{EXT[fmt]}", fmt, ROWS[:5])
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / f".part-2.{EXT[fmt]}.crc").write_text("checksum")
    (tmp_path / "_temporary").mkdir()
    _write(tmp_path / "_temporary" / f"junk.{EXT[fmt]}", fmt, ROWS[:1])

    source = open_source(str(tmp_path))

    assert [f.rsplit("/", 1)[1] for f in source.files] == [f"part-0.{fmt}", f"part-1.{fmt}"]
    assert source.to_table().to_pylist() == ROWS


def test_glob_selects_matching_files(tmp_path):
    _write(tmp_path / "a.parquet", "parquet", ROWS[:3])
    _write(tmp_path / "b.parquet", "parquet", ROWS[3:])
    _write(tmp_path / "c.jsonl", "jsonl", ROWS)

    source = open_source(str(tmp_path / "*.parquet"))

    assert len(source.files) == 2
    assert source.num_rows == 10
    assert source.to_table().column("id").to_pylist() == list(range(10))


def test_hive_partitions_become_typed_columns(tmp_path):
    for year, lang, rows in [(2024, "en", ROWS[:4]), (2025, "fr", ROWS[4:])]:
        directory = tmp_path / f"year={year}" / f"lang={lang}"
        directory.mkdir(parents=True)
        pq.write_table(_table(rows), directory / "part-0.parquet")
    missing = tmp_path / "year=__HIVE_DEFAULT_PARTITION__" / "lang=de"
    missing.mkdir(parents=True)
    pq.write_table(_table(ROWS[:1]), missing / "part-0.parquet")

    source = open_source(f"file://{tmp_path}", columns=["id", "year", "lang"])

    assert source.schema == pa.schema(
        [("id", pa.int64()), ("year", pa.int64()), ("lang", pa.string())]
    )
    rows = source.to_table().to_pylist()
    assert rows[0] == {"id": 0, "year": 2024, "lang": "en"}
    assert rows[4] == {"id": 4, "year": 2025, "lang": "fr"}
    assert rows[-1] == {"id": 0, "year": None, "lang": "de"}


def test_parquet_files_with_evolving_schema_unify(tmp_path):
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3.5], "extra": ["x"]}), tmp_path / "b.parquet")

    table = open_source(str(tmp_path)).to_table()

    assert table.schema == pa.schema([("id", pa.float64()), ("extra", pa.string())])
    assert table.to_pylist() == [
        {"id": 1.0, "extra": None},
        {"id": 2.0, "extra": None},
        {"id": 3.5, "extra": "x"},
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_gzip_is_decompressed_by_suffix(tmp_path, fmt):
    plain = tmp_path / f"plain.{fmt}"
    _write(plain, fmt)
    packed = tmp_path / f"data.{fmt}.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))

    source = open_source(str(packed))

    assert source.format == fmt
    assert source.to_table().to_pylist() == ROWS


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_memory_filesystem(memory_root, fmt):
    fs = fsspec.filesystem("memory")
    with fs.open(f"{memory_root}/in/data.{EXT[fmt]}", "wb") as f:
        if fmt == "parquet":
            pq.write_table(_table(), f)
        elif fmt == "jsonl":
            f.write("".join(json.dumps(r) + "\n" for r in ROWS).encode())
        else:
            pa_csv.write_csv(_table(), f)

    source = open_source(f"{memory_root}/in")

    assert source.files == [f"memory:///{memory_root[len('memory://') :]}/in/data.{EXT[fmt]}"]
    assert source.to_table().to_pylist() == ROWS


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_streaming_yields_many_bounded_batches(tmp_path, fmt):
    rows = [{"id": i, "prompt": f"p{i}", "score": 0.5} for i in range(50_000)]
    path = tmp_path / f"big.{EXT[fmt]}"
    _write(path, fmt, rows)
    if fmt == "parquet":
        pq.write_table(_table(rows), path, row_group_size=20_000)

    sizes = [b.num_rows for b in open_source(str(path), batch_size=3_000).iter_batches()]

    assert sum(sizes) == 50_000
    assert max(sizes) <= 3_000
    assert len(sizes) >= 17  # ceil(50_000 / 3_000); row-group edges may add a few


def test_columns_select_and_order(tmp_path):
    path = tmp_path / "data.jsonl"
    _write(path, "jsonl")

    source = open_source(str(path), columns=["prompt", "id"])

    assert source.schema.names == ["prompt", "id"]
    assert source.to_table().to_pylist()[0] == {"prompt": "question 0", "id": 0}


def test_explicit_format_overrides_extension(tmp_path):
    path = tmp_path / "data.txt"
    _write(path, "jsonl")

    assert open_source(str(path), format="jsonl").to_table().num_rows == 10


def test_skip_row_mode_always_has_error_column(tmp_path):
    path = tmp_path / "data.parquet"
    _write(path, "parquet")

    table = open_source(str(path), on_bad_line="skip_row").to_table()

    assert table.schema.names == ["id", "prompt", "score", ERROR_COLUMN]
    assert table.column(ERROR_COLUMN).null_count == 10


def test_full_validation_counts_rows(tmp_path):
    path = tmp_path / "data.csv"
    _write(path, "csv")

    assert open_source(str(path), validate="full").num_rows == 10


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_http_url_is_read_as_one_file(http_root, fmt):
    base, directory = http_root
    _write(directory / f"data.{EXT[fmt]}", fmt)

    source = open_source(f"{base}/data.{EXT[fmt]}")

    assert source.files == [f"{base}/data.{EXT[fmt]}"]
    assert source.to_table().to_pylist() == ROWS


def test_http_missing_file(http_root):
    base, _ = http_root
    with pytest.raises(SourceError, match=f"{base}/nope.jsonl: path does not exist"):
        open_source(f"{base}/nope.jsonl")
