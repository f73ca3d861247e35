"""Objects and lists in JSON Lines and JSON arrays keep every key and every value, however
late in the file a key first appears: the types of nested columns (and of columns the
head did not show) are settled over the whole file, a value no one type holds makes its
column JSON text, and a value read into a type that would drop part of it is named."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source
from tokenmill.connectors.json_types import MAX_NESTED_FIELDS

PAD = "x" * 1000  # a row of ~1 KB: 1,200 rows put the last ones past the 1 MiB head
HEAD_ROWS = 1100


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(late: dict, early: dict, *, num_rows: int = 1200) -> list[dict]:
    """Rows `early` until past the head, then `late`; each with an id and padding."""
    return [{"id": i, **(early if i < HEAD_ROWS else late), "pad": PAD} for i in range(num_rows)]


def _without_nulls(value):
    """A value as its JSON had it: the keys an Arrow struct fills with null left out."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_a_key_first_seen_past_the_head_is_kept(tmp_path):
    rows = _rows({"meta": {"a": 1, "b": "EXTRA"}}, {"meta": {"a": 1}})
    path = _write_jsonl(tmp_path / "s.jsonl", rows)

    for columns in (None, ["id", "meta"]):
        source = open_source(path, columns=columns)
        meta = source.to_table().column("meta").to_pylist()

        assert source.schema.field("meta").type == pa.struct(
            [("a", pa.int64()), ("b", pa.string())]
        )
        assert meta[HEAD_ROWS - 1] == {"a": 1, "b": None}
        assert meta[HEAD_ROWS:] == [{"a": 1, "b": "EXTRA"}] * (1200 - HEAD_ROWS)


def test_messages_with_a_late_name_and_tool_calls_are_read_whole(tmp_path):
    early = [{"role": "user", "content": "hi"}]
    late = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "user", "content": "thanks"},
    ]
    path = _write_jsonl(tmp_path / "m.jsonl", _rows({"messages": late}, {"messages": early}))

    table = open_source(path, columns=["id", "messages"]).to_table()
    messages = table.column("messages").to_pylist()

    assert [_without_nulls(m) for m in messages[:HEAD_ROWS]] == [early] * HEAD_ROWS
    assert [_without_nulls(m) for m in messages[HEAD_ROWS:]] == [_without_nulls(late)] * (
        1200 - HEAD_ROWS
    )
    assert messages[-1][0]["name"] == "ann"
    assert messages[-1][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_a_key_whose_type_changes_late_makes_the_column_json_text(tmp_path):
    rows = _rows({"meta": {"a": "one", "c": [1, 2]}}, {"meta": {"a": 1}})
    path = _write_jsonl(tmp_path / "t.jsonl", rows)

    source = open_source(path, columns=["id", "meta"])
    meta = source.to_table().column("meta").to_pylist()

    assert source.schema.field("meta").type == pa.string()
    assert [json.loads(m) for m in meta] == [r["meta"] for r in rows]


def test_numbers_widen_and_lists_of_objects_gain_keys(tmp_path):
    rows = _rows(
        {"scores": [{"v": 2.5, "tag": "late"}], "n": {"k": 3.5}},
        {"scores": [{"v": 1}], "n": {"k": 1}},
    )
    path = _write_jsonl(tmp_path / "w.jsonl", rows)

    table = open_source(path, columns=["scores", "n"]).to_table()

    assert table.schema.field("scores").type == pa.list_(
        pa.struct([("v", pa.float64()), ("tag", pa.string())])
    )
    assert table.column("scores").to_pylist()[0] == [{"v": 1.0, "tag": None}]
    assert table.column("scores").to_pylist()[-1] == [{"v": 2.5, "tag": "late"}]
    assert table.column("n").to_pylist()[-1] == {"k": 3.5}


def test_late_keys_survive_the_python_parser_path(tmp_path):
    # A bad line in the chunk sends it through Python's parser (rows_to_batch).
    rows = [json.dumps(r) for r in _rows({"meta": {"a": 2, "b": "late"}}, {"meta": {"a": 1}})]
    rows.insert(HEAD_ROWS + 5, "{oops")
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(rows) + "\n")

    table = open_source(str(path), columns=["id", "meta"], on_bad_line="skip_row").to_table()

    assert table.num_rows == 1201
    assert table.column("meta").to_pylist()[-1] == {"a": 2, "b": "late"}
    assert "line 1106: invalid JSON" in table.column(ERROR_COLUMN).to_pylist()[HEAD_ROWS + 5]
    assert table.column("id").to_pylist()[-1] == 1199


def test_a_value_that_would_lose_a_key_is_named_not_dropped(tmp_path):
    # A given schema is not settled: an object with a key it lacks is that row's error.
    path = _write_jsonl(
        tmp_path / "g.jsonl", [{"meta": {"a": 1}}, {"meta": {"a": 2, "b": 3}}, {"meta": {"a": 1.5}}]
    )
    schema = pa.schema([("meta", pa.struct([("a", pa.int64())]))])

    with pytest.raises(SourceError, match="line 2: column 'meta': key 'b' is not in the column's"):
        open_source(str(path), schema=schema).to_table()
    table = open_source(str(path), schema=schema, on_bad_line="skip_row").to_table()

    assert table.column("meta").to_pylist() == [{"a": 1}, None, None]
    errors = table.column(ERROR_COLUMN).to_pylist()
    assert errors[0] is None
    assert "line 2: column 'meta': key 'b' is not in the column's type" in errors[1]
    assert "line 3: column 'meta': a float value at 'a' does not fit type int64" in errors[2]


def test_a_json_array_settles_its_nested_columns_too(tmp_path):
    rows = _rows({"meta": {"a": 1, "b": [True]}}, {"meta": {"a": 1}})
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows, indent=1))

    table = open_source(str(path), columns=["id", "meta"]).to_table()

    assert table.column("meta").to_pylist()[-1] == {"a": 1, "b": [True]}
    assert table.column("meta").to_pylist()[0] == {"a": 1, "b": None}


def test_a_column_the_head_did_not_show_is_found_or_refused_after_the_whole_file(tmp_path):
    rows = _rows({"late_id": "z"}, {})
    path = _write_jsonl(tmp_path / "c.jsonl", rows)

    table = open_source(path, columns=["id", "late_id"]).to_table()

    assert table.column("late_id").to_pylist() == [None] * HEAD_ROWS + ["z"] * 100
    with pytest.raises(SourceError, match="column\\(s\\) 'nowhere' not found"):
        open_source(path, columns=["id", "nowhere"])


def test_a_limit_settles_the_rows_it_reads_and_a_later_key_is_named(tmp_path):
    rows = _rows({"meta": {"a": 1, "b": "EXTRA"}}, {"meta": {"a": 1}})
    path = _write_jsonl(tmp_path / "l.jsonl", rows)

    # Chunks of 100 lines: the limit ends a chunk, so the scan stops there.
    source = open_source(path, columns=["id", "meta"], limit=HEAD_ROWS, batch_size=100)

    assert source.schema.field("meta").type == pa.struct([("a", pa.int64())])
    limited = pa.Table.from_batches(list(source.iter_batches(limit=HEAD_ROWS)))
    assert limited.column("meta").to_pylist() == [{"a": 1}] * HEAD_ROWS
    # Read past the limit its types were settled for, the first later key is named.
    line = HEAD_ROWS + 1
    with pytest.raises(SourceError, match=f"line {line}: column 'meta': key 'b' is not in"):
        source.to_table()


def test_maps_keyed_by_data_and_keys_only_ever_null(tmp_path):
    wide = {f"k{i}": i for i in range(MAX_NESTED_FIELDS + 1)}
    rows = _rows(
        {"map": wide, "meta": {"a": 1, "gone": None}}, {"map": {"k0": 0}, "meta": {"a": 1}}
    )
    path = _write_jsonl(tmp_path / "k.jsonl", rows)

    source = open_source(path, columns=["map", "meta"])
    table = source.to_table()

    assert source.schema.field("map").type == pa.string()
    assert [json.loads(m) for m in table.column("map").to_pylist()] == [r["map"] for r in rows]
    assert source.schema.field("meta").type == pa.struct([("a", pa.int64()), ("gone", pa.string())])
    assert table.column("meta").to_pylist()[-1] == {"a": 1, "gone": None}


def test_files_of_one_input_settle_together(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [{"id": -1, "meta": {"a": 0}}])
    _write_jsonl(folder / "b.jsonl", _rows({"meta": {"a": 1, "b": "EXTRA"}}, {"meta": {"a": 1}}))

    table = open_source(str(folder), columns=["id", "meta"]).to_table()

    assert table.column("meta").to_pylist()[0] == {"a": 0, "b": None}
    assert table.column("meta").to_pylist()[-1] == {"a": 1, "b": "EXTRA"}
