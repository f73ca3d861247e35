"""CSV records split from a byte stream, quotes honoured, before any field is parsed.

Knowing where each record starts and ends (and on which line) before parsing is what
lets one record fail alone: a record whose bytes do not decode, or that is larger than
the limit, becomes a bad line, and every other record is parsed. The rules are RFC
4180's, as pyarrow and Python's csv module read them:

- a record ends at a newline (`\\n` or `\\r\\n`) outside quotes;
- a quote opens a quoted field only as a field's first byte (after `,`, a newline or the
  start of the file); anywhere else it is an ordinary byte;
- inside a quoted field, `""` is a literal quote and newlines belong to the field; the
  next lone quote closes it.

The stream is scanned in 1 MiB reads with `bytes.find`, so memory is one read plus the
record being collected; a record past the limit stops being collected (it comes out as
an `OversizedLine`) while the scan goes on to find its end.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenmill.connectors.lines import MAX_LINE_BYTES, OversizedLine

_READ_BYTES = 1 << 20
_QUOTE = 0x22
_COMMA = 0x2C
_NEWLINE = 0x0A
# Bytes after which a quote opens a quoted field (None: the start of the file).
_FIELD_START = (None, _COMMA, _NEWLINE)


def iter_records(fileobj, max_record_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Yields `(line_number, record)` for each non-empty record, without its newline.

    Args:
        fileobj: a binary stream (`decoding.open_decoded`).
        max_record_bytes: the largest record kept (default MAX_LINE_BYTES); a larger
            one is yielded as an `OversizedLine` holding only its size.

    Returns:
        An iterator; `line_number` is the 1-based line the record starts on (a quoted
        field holding newlines makes a record span several lines).
    """
    splitter = _Splitter(MAX_LINE_BYTES if max_record_bytes is None else max_record_bytes)
    while True:
        data = fileobj.read(_READ_BYTES)
        if not data:
            break
        yield from splitter.feed(data)
    yield from splitter.finish()


class _Splitter:
    """The scan's state between reads: inside quotes or not, and the record so far."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_quotes = False
        self.quote_at_end = False  # inside quotes, a read ended on a quote: `""` or closing?
        self.last_byte: int | None = None
        self.line = 1  # the line the current record starts on
        self.pieces: list[bytes] = []  # the current record's bytes from earlier reads
        self.size = 0
        self.newlines = 0  # counted in `pieces`
        self.is_quoted = False  # the current record opened a quoted field

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The records that end in `data` (the rest is kept for the next read)."""
        out: list[tuple[int, bytes]] = []
        n = len(data)
        start = 0  # where the current record's bytes begin in `data`
        i = 0
        if self.quote_at_end:
            self.quote_at_end = False
            if data[0] == _QUOTE:
                i = 1  # `""`: a literal quote, still inside
            else:
                self.in_quotes = False
        while i < n:
            if self.in_quotes:
                q = data.find(b'"', i)
                if q < 0 or q == n - 1:
                    self.quote_at_end = q == n - 1
                    break
                if data[q + 1] == _QUOTE:
                    i = q + 2
                else:
                    self.in_quotes, i = False, q + 1
                continue
            q = data.find(b'"', i)
            stop = n if q < 0 else q
            first = data.find(b"\n", i, stop)
            if first >= 0:
                # Every newline before the next quote ends a record; those between the
                # first and the last hold no quote at all.
                last = data.rfind(b"\n", first, stop)
                self._end(data[start:first], out)
                if last > first:
                    for line in data[first + 1 : last].split(b"\n"):
                        self._plain(line, out)
                start = last + 1
            if q < 0:
                break
            before = data[q - 1] if q > 0 else self.last_byte
            if before in _FIELD_START:
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
        self.newlines += piece.count(b"\n")
        self.size += len(piece)
        if self.size <= self.limit:
            self.pieces.append(piece)
        else:
            self.pieces = []  # past the limit: keep counting, not storing

    def _end(self, tail: bytes, out: list[tuple[int, bytes]]) -> None:
        """Ends the current record with `tail` (its last bytes, before the newline)."""
        if not self.size:  # the whole record is in this read: no copy
            newlines = tail.count(b"\n") if self.is_quoted else 0
            self.pieces, self.is_quoted = [], False
            self._plain(tail, out, newlines)
            return
        self._keep(tail)
        line, size = self.line, self.size
        self.line += self.newlines + 1
        if size > self.limit:
            out.append((line, OversizedLine(size)))
        else:
            record = b"".join(self.pieces)
            record = record[:-1] if record.endswith(b"\r") else record
            if record:
                out.append((line, record))
        self.pieces, self.size, self.newlines, self.is_quoted = [], 0, 0, False

    def _plain(self, line: bytes, out: list[tuple[int, bytes]], newlines: int = 0) -> None:
        """A record wholly inside one read, holding `newlines` inside quoted fields."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > self.limit:
            out.append((self.line, OversizedLine(len(line))))
        elif line:
            out.append((self.line, line))
        self.line += newlines + 1
