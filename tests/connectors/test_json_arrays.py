"""`.json` files: a top-level array of objects streamed element by element (bounded
memory, an error row per bad element naming its index, a syntax error naming its byte
offset), JSON Lines told apart by the first byte, and an object wrapping the rows
refused with the key that holds them."""

from __future__ import annotations

import io
import json
import random
import tracemalloc

import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source
from tokenmill.connectors.json_array import ArraySyntaxError, iter_elements, parse_element
from tokenmill.connectors.lines import OversizedLine


class Trickle(io.RawIOBase):
    """A few bytes per read: every state the splitter keeps between reads is hit."""

    def __init__(self, data: bytes, seed: int):
        self.data, self.pos, self.rng = data, 0, random.Random(seed)

    def read(self, size: int = -1) -> bytes:
        piece = self.data[self.pos : self.pos + self.rng.randint(1, 7)]
        self.pos += len(piece)
        return piece


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 5 if depth < 3 else 1)
    if kind == 0:
        return rng.choice([0, -12, 2.5e-3, True, False, None])
    if kind == 1:
        alphabet = ['"', "\\", "[", "]", "{", "}", ",", "a", "é", "\n", " ", "\u2028"]
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
    if kind in (2, 3):
        return {rng.choice("abc"): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_elements_are_split_as_json_parses_the_whole_array():
    rng = random.Random(5)
    for trial in range(200):
        values = [_random_value(rng) for _ in range(rng.randint(0, 8))]
        data = json.dumps(
            values, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5
        ).encode()
        for seed in (None, trial):
            stream = io.BytesIO(data) if seed is None else Trickle(data, seed)
            assert [parse_element(e) for e in iter_elements(stream)] == values, (trial, seed)


@pytest.mark.parametrize(
    ("data", "offset", "why"),
    [
        (b'[{"a": 1} {"a": 2}]', 10, "expected ',' or ']' after an element"),
        (b'[{"a": 1},]', 10, "expected an element"),
        (b'[{"a": 1}, {"a": 2}', 19, "the file ends before the array's ']'"),
        (b'[{"a": "x}]', 11, "the file ends in an element"),
        (b'[{"a": 1}] trailing', 11, "data after the array's closing ']'"),
        (b'[{"a": 1}, {"a": tru}]', 17, "Expecting value"),
    ],
)
def test_a_syntax_error_names_its_byte_offset(data, offset, why):
    with pytest.raises(ArraySyntaxError) as raised:
        [parse_element(e) for e in iter_elements(io.BytesIO(data))]
    assert raised.value.offset == offset
    assert str(raised.value) == f"invalid JSON at byte {offset:,} ({why})"


class Generated(io.RawIOBase):
    """`[` + `element` repeated `count` times + `]`, made as it is read (never whole)."""

    def __init__(self, element: bytes, count: int):
        self.element, self.left, self.started, self.done = element, count, False, False

    def read(self, size: int = -1) -> bytes:
        if not self.started:
            self.started = True
            return b"["
        if self.left > 0:
            take = min(self.left, (1 << 20) // len(self.element))
            self.left -= take
            return self.element * take
        if not self.done:
            self.done = True
            return b"{}]"
        return b""


def test_a_large_array_is_read_in_bounded_memory():
    element = json.dumps({"id": "x" * 20, "prompt": "a pasted line of text, " * 4}).encode() + b","
    count = (32 << 20) // len(element)  # 32 MiB of array, never held whole

    tracemalloc.start()
    try:
        seen = sum(1 for _ in iter_elements(Generated(element, count)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert seen == count + 1
    assert peak < 6 << 20, peak  # a read and the elements found in it, not the array


def test_an_element_over_the_limit_is_counted_not_kept():
    big = b'{"big": "' + b"x" * 100 + b'", "b": [1]}'

    got = list(iter_elements(io.BytesIO(b'[{"a": 1}, ' + big + b", 3]"), 60))

    assert [e.index for e in got] == [0, 1, 2]
    assert isinstance(got[1].data, OversizedLine) and got[1].data.size == len(big)
    assert parse_element(got[2]) == 3


def _write(tmp_path, name, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_a_json_array_is_read_as_rows(tmp_path):
    rows = [{"id": f"r{i}", "q": f"question {i}", "n": i} for i in range(25)]
    path = _write(tmp_path, "rows.json", json.dumps(rows, indent=2).encode())

    source = open_source(path, batch_size=7)

    assert source.format == "json"
    assert source.to_table().to_pylist() == rows
    assert max(b.num_rows for b in source.iter_batches()) == 7


def test_a_bad_element_in_the_middle_is_one_error_row_naming_its_index(tmp_path):
    elements = [
        {"id": "a", "q": "first"},
        [1, 2],  # not an object
        {"id": "c", "q": {"not": "text"}},  # not text where text is needed
        {"id": "d", "q": "last"},
    ]
    path = _write(tmp_path, "rows.json", json.dumps(elements).encode())

    table = open_source(path, on_bad_line="skip_row", text_columns=["q"]).to_table()

    assert table.column("id").to_pylist() == ["a", None, "c", "d"]
    assert table.column("q").to_pylist() == ["first", None, None, "last"]
    assert table.column(ERROR_COLUMN).to_pylist() == [
        None,
        f"{path}: array index 1: expected a JSON object, got list",
        f"{path}: array index 2: column 'q': a dict value where text was expected",
        None,
    ]
    with pytest.raises(SourceError, match="array index 1: expected a JSON object, got list"):
        open_source(path)


def test_invalid_utf8_and_oversized_elements_are_error_rows(tmp_path):
    data = b'[{"id": "a"}, {"id": "b\xff"}, {"id": "c"}]'
    path = _write(tmp_path, "rows.json", data)

    table = open_source(path, on_bad_line="skip_row").to_table()

    assert table.column("id").to_pylist() == ["a", None, "c"]
    assert table.column(ERROR_COLUMN).to_pylist()[1] == (
        f"{path}: array index 1: not valid UTF-8 (byte 0xff at offset 9)"
    )


def test_a_syntax_error_mid_array_fails_naming_the_byte(tmp_path):
    good = b",".join(json.dumps({"id": str(i), "q": "x" * 100}).encode() for i in range(20_000))
    path = _write(tmp_path, "rows.json", b"[" + good + b' {"id": "late"}]')

    source = open_source(path, on_bad_line="skip_row")  # the head is fine
    with pytest.raises(SourceError) as raised:
        list(source.iter_batches())
    offset = 1 + len(good) + 1
    assert str(raised.value) == (
        f"{path}: invalid JSON at byte {offset:,} (expected ',' or ']' after an element)"
    )


@pytest.mark.parametrize("data", [b"[]", b"  [ \n ]\n", b""])
def test_an_empty_array_or_file_is_empty(tmp_path, data):
    source = open_source(_write(tmp_path, "rows.json", data), columns=["q", "id"])

    assert source.is_empty
    assert source.to_table().num_rows == 0
    assert source.schema.names == ["q", "id"]


def test_json_lines_in_a_json_file_are_read_as_before(tmp_path):
    path = _write(tmp_path, "rows.json", b'\n  {"id": 1}\r\n{"id": 2}\r\n\r\n{"id": 3}\n')
    assert open_source(path).to_table().column("id").to_pylist() == [1, 2, 3]


def test_cr_in_json_lines_is_whitespace(tmp_path):
    # JSON Lines ends lines at \n only: a \r is JSON whitespace, inside a line or at its end.
    path = _write(tmp_path, "rows.jsonl", b'{"id": 1,\r "q": "a"}\r\n{"id": 2, "q": "b\\r"}\r\n')
    rows = open_source(path).to_table().to_pylist()
    assert rows == [{"id": 1, "q": "a"}, {"id": 2, "q": "b\r"}]


def test_an_object_holding_the_rows_is_refused_naming_the_key(tmp_path):
    wrapped = {"meta": {"count": 2}, "data": [{"id": "a"}, {"id": "b"}]}
    path = _write(tmp_path, "rows.json", json.dumps(wrapped, indent=2).encode())

    with pytest.raises(SourceError) as raised:
        open_source(path)

    assert str(raised.value) == (
        f"{path}: the file is one JSON object holding its rows as a list under 'data': "
        "tokenmill reads JSON Lines or a top-level JSON array of objects; write the list "
        "itself (e.g. jq '.data' in.json > rows.json)"
    )


def test_a_large_object_holding_the_rows_is_refused_from_its_head(tmp_path):
    rows = ",\n".join(json.dumps({"id": str(i), "q": "x" * 200}) for i in range(10_000))
    path = _write(tmp_path, "rows.json", b'{\n  "results": [\n' + rows.encode() + b"\n]}\n")
    with pytest.raises(SourceError, match="list under 'results'"):
        open_source(path)


def test_one_line_holding_the_rows_gets_the_hint_when_columns_are_missing(tmp_path):
    path = _write(tmp_path, "rows.json", b'{"data": [{"id": "a", "q": "x"}]}\n')

    with pytest.raises(SourceError) as raised:
        open_source(path, columns=["q"])

    message = str(raised.value)
    assert message.startswith(f"{path}: column(s) 'q' not found; available columns: data - ")
    assert "list under 'data'" in message
    # A line that is a row with a list in it is a row when its columns are asked for.
    assert open_source(path, columns=["data"]).to_table().num_rows == 1


def test_json_lines_with_a_broken_first_line_are_still_json_lines(tmp_path):
    path = _write(tmp_path, "rows.json", b'{"id": "a", "q": "x\n{"id": "b", "q": "y"}\n')
    table = open_source(path, on_bad_line="skip_row").to_table()
    assert table.column("id").to_pylist() == [None, "b"]
    assert "line 1: invalid JSON" in table.column(ERROR_COLUMN).to_pylist()[0]
