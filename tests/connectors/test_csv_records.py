"""CSV records are split before they are parsed: quotes honoured wherever a read ends,
fields up to the limit kept whole, larger ones counted but never held whole."""

from __future__ import annotations

import csv
import io
import random
import tracemalloc

import pyarrow as pa
import pytest

from tokenmill.connectors import ERROR_COLUMN, SourceError, open_source
from tokenmill.connectors.csv_records import Dialect, iter_records
from tokenmill.connectors.lines import MAX_LINE_BYTES, OversizedLine


class Trickle(io.RawIOBase):
    """A stream that hands out a few bytes per read, so every state the splitter keeps
    between reads (inside quotes, a quote as the last byte, a CR before the LF) is hit."""

    def __init__(self, data: bytes, seed: int):
        self.data, self.pos, self.rng = data, 0, random.Random(seed)

    def read(self, size: int = -1) -> bytes:
        take = self.rng.randint(1, 7)
        piece = self.data[self.pos : self.pos + take]
        self.pos += len(piece)
        return piece


def records(data: bytes, *, seed: int | None = None, limit: int | None = None):
    stream = io.BytesIO(data) if seed is None else Trickle(data, seed)
    return list(iter_records(stream, limit))


def test_records_end_at_newlines_outside_quotes():
    data = b'a,b\r\n1,"two\nlines"\n\n2,"say ""hi"", then go"\n3,5" screen\n4,"x""'

    expected = [
        (1, b"a,b"),
        (2, b'1,"two\nlines"'),
        (5, b'2,"say ""hi"", then go"'),  # line 4 is blank: skipped, still counted
        (6, b'3,5" screen'),  # a quote inside a field is an ordinary byte
        (7, b'4,"x""'),  # unterminated at the end of the file: the rest is the record
    ]
    assert records(data) == expected
    for seed in range(50):
        assert records(data, seed=seed) == expected, seed


def test_random_files_split_as_pythons_csv_module_reads_them():
    rng = random.Random(7)
    alphabet = ['"', ",", "\n", "\r\n", "a", "é", " ", "x" * 3]
    rows = [
        ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(3)]
        for _ in range(300)
    ]
    text = io.StringIO(newline="")
    csv.writer(text, lineterminator="\r\n").writerows(rows)
    data = text.getvalue().encode()

    for seed in (None, 1, 2, 3):
        split = records(data, seed=seed)
        got = [next(csv.reader(io.StringIO(r.decode(), newline=""))) for _, r in split]
        assert got == rows, seed


def test_a_record_over_the_limit_is_counted_not_kept():
    data = b"1,short\n" + b'2,"' + b"x\n" * 30 + b'"\n3,after\n'

    got = records(data, limit=40)

    assert got[0] == (1, b"1,short")
    assert isinstance(got[1][1], OversizedLine) and got[1] == (2, got[1][1])
    assert got[1][1].size == 3 + 60 + 1
    assert got[2] == (33, b"3,after")  # 30 newlines inside the quoted field


class Repeated(io.RawIOBase):
    """`head`, then `body` repeated to `size` bytes, then `tail`, made as it is read."""

    def __init__(self, head: bytes, body: bytes, size: int, tail: bytes):
        self.parts = [head, body, tail]
        self.left = size

    def read(self, size: int = -1) -> bytes:
        if self.parts[0]:
            piece, self.parts[0] = self.parts[0], b""
            return piece
        if self.left > 0:
            body = self.parts[1]
            piece = body * min(self.left // len(body) or 1, (1 << 20) // len(body))
            self.left -= len(piece)
            return piece
        piece, self.parts[2] = self.parts[2], b""
        return piece


def test_a_40_mb_field_is_never_held_whole():
    stream = Repeated(b'id,prompt\n1,hi\n2,"', b"abc,\n" * 64, 40 << 20, b'"\n3,bye\n')

    tracemalloc.start()
    try:
        got = [
            (n, r if isinstance(r, OversizedLine) else bytes(r)) for n, r in iter_records(stream)
        ]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert [n for n, _ in got] == [1, 2, 3, 3 + (40 << 20) // 5 + 1]
    assert isinstance(got[2][1], OversizedLine) and got[2][1].size > MAX_LINE_BYTES
    assert got[3][1] == b"3,bye"
    # What was collected before the record passed the limit, and one read: not the field.
    assert peak < MAX_LINE_BYTES + (4 << 20), peak


def _csv_with_field(tmp_path, field_bytes: int, *, lead_bytes: int = 0):
    path = tmp_path / "d.csv"
    with open(path, "wb") as f:
        f.write(b"id,prompt\n")
        f.write(b"0,lead " + b"y" * lead_bytes + b"\n")
        f.write(b'1,"')
        for _ in range(field_bytes >> 20):
            f.write((b"line one, with a comma\n" * 45591)[: 1 << 20])
        f.write(b'"\n2,good\n')
    return str(path)


def test_a_csv_field_over_the_limit_is_an_error_row_naming_its_line(tmp_path):
    path = _csv_with_field(tmp_path, 40 << 20)

    table = open_source(path, on_bad_line="skip_row").to_table()

    assert table.column("id").to_pylist() == [0, None, 2]
    assert table.column("prompt").to_pylist()[2] == "good"
    (error,) = [e for e in table.column(ERROR_COLUMN).to_pylist() if e]
    assert error.startswith(f"{path}: line 3: longer than the record limit of 32 MiB (")
    with pytest.raises(SourceError, match="line 3: longer than the record limit"):
        open_source(path).to_table()


@pytest.mark.parametrize("lead_bytes", [0, (1 << 20) - 30, (1 << 20) - 12])
def test_a_csv_field_under_the_limit_is_read_whole_wherever_it_falls(tmp_path, lead_bytes):
    # A 20 MiB quoted field holding newlines, starting near a 1 MiB read boundary.
    path = _csv_with_field(tmp_path, 20 << 20, lead_bytes=lead_bytes)

    table = open_source(path, on_bad_line="skip_row").to_table()

    assert table.column("id").to_pylist() == [0, 1, 2]
    assert len(table.column("prompt")[1].as_py()) == 20 << 20
    assert table.column(ERROR_COLUMN).null_count == 3
    assert table.schema.field("prompt").type == pa.string()


@pytest.mark.parametrize("terminator", ["\n", "\r\n", "\r"])
def test_every_line_break_ends_records_as_pythons_csv_module_reads_them(terminator):
    # Fields hold all three line breaks, quotes and the delimiter; Python's csv module
    # (which reads a bare CR as a line break too) is the reference.
    rng = random.Random(terminator)
    for delimiter in (",", ";", "\t", "|"):
        alphabet = ['"', delimiter, "\n", "\r\n", "\r", "a", "é", " ", "xyz"]
        rows = [
            ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(3)]
            for _ in range(200)
        ]
        text = io.StringIO(newline="")
        csv.writer(text, delimiter=delimiter, lineterminator=terminator).writerows(rows)
        data = text.getvalue().encode()
        expected = list(csv.reader(io.StringIO(data.decode(), newline=""), delimiter=delimiter))

        for seed in (None, 1, 2, 3):
            stream = io.BytesIO(data) if seed is None else Trickle(data, seed)
            split = iter_records(stream, dialect=Dialect(delimiter))
            got = [
                next(csv.reader(io.StringIO(r.decode(), newline=""), delimiter=delimiter))
                for _, r in split
            ]
            assert got == [r for r in expected if r], (delimiter, seed)


def test_blank_records_are_reported_where_they_fall():
    # \r\r\n is a bare CR and then a CRLF: one blank record between them, as csv reads it.
    data = b'a,b\r\r\n1,2\r\r3,"x\r\ny"\r4,5\n\n'
    blanks: list[int] = []

    got = list(iter_records(io.BytesIO(data), on_blank=blanks.append))

    assert got == [(1, b"a,b"), (3, b"1,2"), (5, b'3,"x\r\ny"'), (7, b"4,5")]
    assert blanks == [1, 2, 4]  # the records before each blank one
    python_rows = list(csv.reader(io.StringIO(data.decode(), newline="")))
    assert sum(1 for r in python_rows if not r) == len(blanks)
    for seed in range(30):
        again: list[int] = []
        assert list(iter_records(Trickle(data, seed), on_blank=again.append)) == got, seed
        assert again == blanks, seed


def test_a_bare_cr_record_over_the_limit_is_counted_like_any_other():
    data = b"1,short\r" + b'2,"' + b"x\r" * 30 + b'"\r3,after\r'

    got = records(data, limit=40)

    assert got[0] == (1, b"1,short")
    assert isinstance(got[1][1], OversizedLine) and got[1][1].size == 3 + 60 + 1
    assert got[2] == (33, b"3,after")  # 30 line breaks inside the quoted field


def test_the_delimiter_and_quote_are_one_ascii_character():
    assert Dialect("\\t").delimiter == "\t"  # as a shell passes it
    assert Dialect(";", "'").quote == "'"
    for delimiter in ("", ";;", "§", "\n"):
        with pytest.raises(ValueError, match="one ASCII character"):
            Dialect(delimiter)
    with pytest.raises(ValueError, match="both ';'"):
        Dialect(";", ";")


def test_a_bare_cr_file_reads_as_pythons_csv_module_and_pandas_read_it(tmp_path):
    import pandas as pd

    path = tmp_path / "cr.csv"
    path.write_bytes(b'id,q\r1,hello\r2,"two\r\nlines"\r3,"bare\rcr"\r\r4,"say ""hi"""\r')

    text = pa.schema([("id", pa.string()), ("q", pa.string())])
    rows = open_source(str(path), schema=text).to_table().to_pylist()

    reference = list(csv.DictReader(io.StringIO(path.read_bytes().decode(), newline="")))
    assert rows == reference
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    assert rows == frame.to_dict("records")
    assert [r["id"] for r in rows] == ["1", "2", "3", "4"]
