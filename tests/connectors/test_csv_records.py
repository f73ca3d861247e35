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
from tokenmill.connectors.csv_records import iter_records
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
