"""Lines that do not parse or fit: error by default, error rows with on_bad_line="skip_row"."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source


def _jsonl(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def test_values_of_varying_type_load_as_strings(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"v": 1}, {"v": "two"}, {"v": {"n": 3}}, {"v": None}])

    table = open_source(path).to_table()

    assert table.schema == pa.schema([("v", pa.string())])
    assert table.column("v").to_pylist() == ["1", "two", '{"n": 3}', None]


def test_keys_missing_or_added_later(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"a": 1}, {"a": 2, "b": "x"}, {"b": "y", "c": 1}])

    table = open_source(path).to_table()

    assert table.to_pylist() == [
        {"a": 1, "b": None, "c": None},
        {"a": 2, "b": "x", "c": None},
        {"a": None, "b": "y", "c": 1},
    ]


def test_columns_only_empty_in_the_head_keep_later_values_as_json_text(tmp_path):
    rows = [{"tags": [], "meta": {}, "x": None}] * 30_000 + [{"tags": ["a"], "meta": {"k": 1}}]
    path = _jsonl(tmp_path / "d.jsonl", rows)

    source = open_source(path)

    assert source.schema == pa.schema(
        [("tags", pa.string()), ("meta", pa.string()), ("x", pa.string())]
    )
    last = source.to_table().slice(30_000).to_pylist()
    assert last == [{"tags": '["a"]', "meta": '{"k": 1}', "x": None}]


def test_nested_values_keep_their_structure(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": messages}, {"messages": None}])

    table = open_source(path).to_table()

    assert table.column("messages").to_pylist() == [messages, None]


def test_skip_row_turns_bad_lines_into_error_rows_in_place(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"id": 1}, "{oops", {"id": 3}, "[1, 2]", {"id": 5}])

    table = open_source(path, on_bad_line="skip_row").to_table()

    assert table.column("id").to_pylist() == [1, None, 3, None, 5]
    errors = table.column(ERROR_COLUMN).to_pylist()
    assert errors[0] is None and errors[2] is None and errors[4] is None
    assert errors[1].startswith(f"{path}: line 2: invalid JSON")
    assert errors[3] == f"{path}: line 4: expected a JSON object, got list"


def test_value_not_fitting_the_inferred_type_beyond_the_head(tmp_path):
    lines = [{"n": i} for i in range(100_000)] + [{"n": 1.5}, {"n": 7}]
    path = _jsonl(tmp_path / "d.jsonl", lines)

    source = open_source(path, batch_size=30_000)
    assert source.schema.field("n").type == pa.int64()
    with pytest.raises(SourceError, match="line 100001: column 'n': a float value does not fit"):
        list(source.iter_batches())

    table = open_source(path, batch_size=30_000, on_bad_line="skip_row").to_table()
    assert table.column("n").to_pylist()[-3:] == [99_999, None, 7]
    assert "line 100001" in table.column(ERROR_COLUMN).to_pylist()[-2]


def test_error_messages_never_quote_the_data(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"x": 1}, '{"x": "SECRET-PROMPT" oops}'])

    with pytest.raises(SourceError) as info:
        open_source(path)

    assert "SECRET-PROMPT" not in str(info.value)


def test_explicit_schema_overrides_inference(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"n": 1, "when": "2024-05-01T10:00:00"}, {"n": 2.5}])
    schema = pa.schema([("n", pa.float64()), ("when", pa.timestamp("s"))])

    table = open_source(path, schema=schema).to_table()

    assert table.schema == schema
    assert table.column("n").to_pylist() == [1.0, 2.5]


def test_csv_rows_with_wrong_field_count(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n1,x\n2,y,EXTRA\n3,z\n")

    with pytest.raises(SourceError) as info:
        open_source(str(path))
    assert str(info.value) == f"{path}: line 3: expected 2 columns, got 3"

    # The error row stands where the bad line was, so position ids follow the file.
    table = open_source(str(path), on_bad_line="skip_row").to_table()
    assert table.to_pylist() == [
        {"a": 1, "b": "x", ERROR_COLUMN: None},
        {"a": None, "b": None, ERROR_COLUMN: f"{path}: line 3: expected 2 columns, got 3"},
        {"a": 3, "b": "z", ERROR_COLUMN: None},
    ]


def test_files_that_disagree_on_guessed_types_fall_back_to_string(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"v": 1}])
    _jsonl(tmp_path / "b.jsonl", [{"v": "x"}])

    table = open_source(str(tmp_path)).to_table()

    assert table.column("v").to_pylist() == ["1", "x"]


def test_csv_column_empty_in_the_first_block_is_text(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n" + "1,\n" * 150_000 + "2,late\n")

    table = open_source(str(path)).to_table()

    assert table.schema.field("b").type == pa.string()
    assert table.column("b").to_pylist()[-1] == "late"


def test_text_columns_refuse_non_text_values(tmp_path):
    lines = [{"id": "a", "p": "hi"}, {"id": "b", "p": 42}, {"id": "c", "p": ["x"]}, {"id": "d"}]
    path = _jsonl(tmp_path / "d.jsonl", lines)

    kept = open_source(path).to_table()
    assert kept.column("p").to_pylist() == ["hi", "42", '["x"]', None]  # JSON spelling

    table = open_source(path, on_bad_line="skip_row", text_columns=["p"]).to_table()
    assert table.column("p").to_pylist() == ["hi", None, None, None]
    assert table.column("id").to_pylist() == ["a", "b", "c", "d"]  # the row keeps its id
    assert table.column(ERROR_COLUMN).to_pylist() == [
        None,
        f"{path}: line 2: column 'p': a int value where text was expected",
        f"{path}: line 3: column 'p': a list value where text was expected",
        None,
    ]
    with pytest.raises(SourceError, match="line 2: column 'p': a int value"):
        open_source(path, text_columns=["p"]).to_table()
