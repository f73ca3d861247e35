"""CSV records split from a byte stream, quotes honoured, before any field is parsed.

Knowing where each record starts and ends (and on which line) before parsing is what
lets one record fail alone: a record whose bytes do not decode, or that is larger than
the limit, becomes a bad line, and every other record is parsed. The rules are RFC
4180's, as Python's csv module and pandas read them, for any one-byte delimiter and
quote (`Dialect`):

- a record ends at a line break outside quotes: `\\n`, `\\r\\n` or a bare `\\r` (what
  old Mac tools and some exports write) - the three alike, a line break each;
- a quote opens a quoted field only as a field's first byte (after the delimiter, a line
  break or the start of the file); anywhere else it is an ordinary byte;
- inside a quoted field, a doubled quote is a literal quote and line breaks of any kind
  belong to the field; the next lone quote closes it;
- an empty record (a line break right after another) is blank: it is not yielded, but
  `on_blank` hears of it, so that a job can count every record it read.

The stream is scanned in 1 MiB reads with `bytes.find` and one compiled pattern, so
memory is one read plus the record being collected; a record past the limit stops being
collected (it comes out as an `OversizedLine`) while the scan goes on to find its end.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokenmill.connectors.lines import MAX_LINE_BYTES, OversizedLine

_READ_BYTES = 1 << 20
_CR, _LF = 0x0D, 0x0A
# One line break; `\r\n` is tried first, so it is one break, not two.
_BREAK = re.compile(rb"\r\n|\r|\n")


def csv_character(value: str) -> str:
    """`value` as a CSV delimiter or quote: one ASCII character, `\\t` written as two
    characters meaning a tab (as a shell passes it); ValueError otherwise."""
    if value == "\\t":
        value = "\t"
    if len(value) != 1 or not value.isascii() or value in "\r\n":
        raise ValueError(
            f"must be one ASCII character other than a line break (e.g. ';', '|', '\\t' for "
            f"a tab), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Dialect:
    """How a delimited text file separates and quotes its fields."""

    delimiter: str = ","
    quote: str = '"'

    def __post_init__(self) -> None:
        object.__setattr__(self, "delimiter", csv_character(self.delimiter))
        object.__setattr__(self, "quote", csv_character(self.quote))
        if self.delimiter == self.quote:
            raise ValueError(f"the delimiter and the quote are both {self.delimiter!r}")


COMMA = Dialect()


def count_breaks(data: bytes) -> int:
    """The line breaks in `data`, `\\r\\n` counting as one."""
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


def iter_records(
    fileobj,
    max_record_bytes: int | None = None,
    *,
    dialect: Dialect = COMMA,
    on_blank: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yields `(line_number, record)` for each non-empty record, without its line break.

    Args:
        fileobj: a binary stream (`decoding.open_decoded`).
        max_record_bytes: the largest record kept (default MAX_LINE_BYTES); a larger
            one is yielded as an `OversizedLine` holding only its size.
        dialect: the delimiter and quote.
        on_blank: called with the number of records yielded before it for each blank
            record (the header is a record here).

    Returns:
        An iterator; `line_number` is the 1-based line the record starts on (a quoted
        field holding line breaks makes a record span several lines).
    """
    limit = MAX_LINE_BYTES if max_record_bytes is None else max_record_bytes
    splitter = _Splitter(limit, dialect, on_blank)
    while True:
        data = fileobj.read(_READ_BYTES)
        if not data:
            break
        yield from splitter.feed(data)
    yield from splitter.finish()


class _Splitter:
    """The scan's state between reads: inside quotes or not, and the record so far."""

    def __init__(self, limit: int, dialect: Dialect, on_blank: Callable[[int], None] | None):
        self.limit = limit
        self.quote = dialect.quote.encode()
        self.quote_byte = self.quote[0]
        # Bytes after which a quote opens a quoted field (None: the start of the file).
        self.field_start = (None, ord(dialect.delimiter), _LF, _CR)
        self.on_blank = on_blank
        self.in_quotes = False
        self.quote_at_end = False  # inside quotes, a read ended on a quote: doubled or closing?
        self.cr_at_end = False  # outside quotes, a read ended on `\r`: a `\n` next is its pair
        self.last_byte: int | None = None
        self.line = 1  # the line the current record starts on
        self.pieces: list[bytes] = []  # the current record's bytes from earlier reads
        self.size = 0
        self.breaks = 0  # line breaks inside quoted fields, counted in `pieces`
        self.piece_ends_cr = False  # the last kept piece ended with `\r`
        self.is_quoted = False  # the current record opened a quoted field
        self.num_records = 0  # records yielded so far

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The records that end in `data` (the rest is kept for the next read)."""
        out: list[tuple[int, bytes]] = []
        n = len(data)
        start = 0  # where the current record's bytes begin in `data`
        i = 0
        if self.cr_at_end:
            self.cr_at_end = False
            if data[0] == _LF:
                start = i = 1  # the second half of a `\r\n` split between reads
        if self.quote_at_end:
            self.quote_at_end = False
            if data[0] == self.quote_byte:
                i = 1  # a doubled quote: a literal one, still inside
            else:
                self.in_quotes = False
        while i < n:
            if self.in_quotes:
                q = data.find(self.quote, i)
                if q < 0 or q == n - 1:
                    self.quote_at_end = q == n - 1
                    break
                if data[q + 1] == self.quote_byte:
                    i = q + 2
                else:
                    self.in_quotes, i = False, q + 1
                continue
            q = data.find(self.quote, i)
            stop = n if q < 0 else q
            first = _BREAK.search(data, i, stop)
            if first is not None:
                # Every line break before the next quote ends a record; those between
                # the first and the last hold no quote at all.
                last_start, last_end = _last_break(data, first.start(), stop)
                self._end(data[start : first.start()], out)
                if last_start > first.start():
                    for line in _BREAK.split(data[first.end() : last_start]):
                        self._plain(line, out)
                start = last_end
                self.cr_at_end = last_end == n and data[last_start] == _CR
            if q < 0:
                break
            before = data[q - 1] if q > 0 else self.last_byte
            if before in self.field_start:
                self.in_quotes = self.is_quoted = True
            i = q + 1
        self._keep(data[start:])
        self.last_byte = data[-1]
        return out

    def finish(self) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        if self.size:
            self._end(b"", out)
        return out

    def _keep(self, piece: bytes) -> None:
        if not piece:
            return
        self.breaks += count_breaks(piece)
        if self.piece_ends_cr and piece[0] == _LF:
            self.breaks -= 1  # a `\r\n` inside quotes, split between reads: one break
        self.piece_ends_cr = piece[-1] == _CR
        self.size += len(piece)
        if self.size <= self.limit:
            self.pieces.append(piece)
        else:
            self.pieces = []  # past the limit: keep counting, not storing

    def _end(self, tail: bytes, out: list[tuple[int, bytes]]) -> None:
        """Ends the current record with `tail` (its last bytes, before the line break)."""
        if not self.size:  # the whole record is in this read: no copy
            breaks = count_breaks(tail) if self.is_quoted else 0
            self.is_quoted = False
            self._plain(tail, out, breaks)
            return
        self._keep(tail)
        line, size = self.line, self.size
        self.line += self.breaks + 1
        if size > self.limit:
            self._yield(line, OversizedLine(size), out)
        else:
            self._yield(line, b"".join(self.pieces), out)
        self.pieces, self.size, self.breaks, self.is_quoted = [], 0, 0, False
        self.piece_ends_cr = False

    def _plain(self, line: bytes, out: list[tuple[int, bytes]], breaks: int = 0) -> None:
        """A record wholly inside one read, holding `breaks` inside quoted fields."""
        if len(line) > self.limit:
            self._yield(self.line, OversizedLine(len(line)), out)
        else:
            self._yield(self.line, line, out)
        self.line += breaks + 1

    def _yield(self, line: int, record: bytes, out: list[tuple[int, bytes]]) -> None:
        if record:
            out.append((line, record))
            self.num_records += 1
        elif self.on_blank is not None:
            self.on_blank(self.num_records)


def _last_break(data: bytes, first: int, stop: int) -> tuple[int, int]:
    """(start, end) of the last line break in `data[first:stop]`, which holds one."""
    last_lf = data.rfind(b"\n", first, stop)
    last_cr = data.rfind(b"\r", first, stop)
    if last_lf > last_cr:
        is_pair = last_cr >= 0 and last_lf - 1 == last_cr  # `\r\n`
        return (last_cr if is_pair else last_lf), last_lf + 1
    return last_cr, last_cr + 1
