"""Delimited text other than commas: a delimiter and quote of the user's, `.tsv` files
read with tabs, and a header that looks like another delimiter's named in the error."""

from __future__ import annotations

import csv
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source


def _write(path, rows, delimiter, quotechar='"'):
    text = io.StringIO(newline="")
    csv.writer(text, delimiter=delimiter, quotechar=quotechar, lineterminator="\r\n").writerows(
        rows
    )
    path.write_text(text.getvalue(), encoding="utf-8", newline="")
    return str(path)


ROWS = [
    ["id", "q"],
    ["1", "a; b | c\td"],
    ["2", 'say "hi"; then\r\ngo'],
    ["3", "plain"],
]


@pytest.mark.parametrize("delimiter", [";", "|", "\t", ":"])
def test_a_delimiter_reads_rows_as_pythons_csv_module_does(tmp_path, delimiter):
    path = _write(tmp_path / "d.csv", ROWS, delimiter)

    table = open_source(path, csv_delimiter=delimiter).to_table()

    assert table.column_names == ["id", "q"]
    assert table.to_pylist() == [{"id": int(r[0]), "q": r[1]} for r in ROWS[1:]]


def test_a_quote_character_of_the_users(tmp_path):
    path = _write(tmp_path / "d.csv", ROWS, ";", quotechar="'")

    rows = open_source(path, csv_delimiter=";", csv_quote="'").to_table().to_pylist()

    assert [r["q"] for r in rows] == [r[1] for r in ROWS[1:]]


@pytest.mark.parametrize("name", ["d.tsv", "d.tab", "d.tsv.gz"])
def test_tsv_and_tab_files_are_read_with_tabs(tmp_path, name):
    import gzip

    data = io.StringIO(newline="")
    csv.writer(data, delimiter="\t", lineterminator="\n").writerows(ROWS)
    raw = data.getvalue().encode()
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)

    source = open_source(str(tmp_path / name))

    assert source.format == "tsv"
    assert [r["q"] for r in source.to_table().to_pylist()] == [r[1] for r in ROWS[1:]]


def test_a_tsv_delimiter_may_be_given_as_written(tmp_path):
    path = _write(tmp_path / "d.txt", ROWS, "\t")
    rows = open_source(path, format="csv", csv_delimiter="\\t").to_table().to_pylist()
    assert [r["id"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize(
    ("delimiter", "suggestion"),
    [(";", "--csv-delimiter ';'"), ("\t", "--csv-delimiter '\\t'"), ("|", "--csv-delimiter '|'")],
)
def test_a_header_of_one_column_holding_a_delimiter_suggests_it(tmp_path, delimiter, suggestion):
    path = _write(tmp_path / "d.csv", ROWS, delimiter)

    with pytest.raises(SourceError) as raised:
        open_source(path, columns=["q", "id"])

    message = str(raised.value)
    assert message.startswith(f"{path}: column(s) 'q', 'id' not found; available columns: id")
    assert message.endswith(
        f"-delimited? Set the delimiter: {suggestion} (csv_delimiter= in Python)"
    )
    assert "\n" not in message


def test_no_suggestion_for_a_header_of_several_columns(tmp_path):
    path = _write(tmp_path / "d.csv", [["id;x", "other"], ["1", "2"]], ",")
    with pytest.raises(SourceError) as raised:
        open_source(path, columns=["q"])
    assert "delimiter" not in str(raised.value)


def test_delimiter_options_are_refused_for_other_formats(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a"]}), path)
    with pytest.raises(ValueError, match="csv_delimiter and csv_quote are for delimited text"):
        open_source(str(path), csv_delimiter=";")
    with pytest.raises(ValueError, match="one ASCII character"):
        open_source(str(path), csv_delimiter="§")


def test_a_header_swallowed_by_an_open_quote_is_not_an_empty_file(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'id,"q\n1,a\n2,b\n')

    with pytest.raises(SourceError, match=r"line 1: the header runs over 4 lines .* quote left"):
        open_source(str(path))


def test_wrong_field_counts_stay_error_rows_with_another_delimiter(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"id;q\r1;a\r2;b;extra\r3;c\r")

    table = open_source(str(path), csv_delimiter=";", on_bad_line="skip_row").to_table()

    assert table.column("id").to_pylist() == [1, None, 3]
    assert table.column(ERROR_COLUMN).to_pylist()[1] == (
        f"{path}: line 3: expected 2 columns, got 3"
    )
