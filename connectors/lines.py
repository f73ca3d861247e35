"""Line-oriented reading shared by the JSON Lines formats, and the bad-line stand-ins.

Lines are split from an `open_decoded` stream (`connectors/decoding.py`) and checked one
by one: a line over the size limit or whose bytes do not decode is replaced by a
stand-in (`OversizedLine`, `UndecodableLine`) that reads as a bad line naming the
problem, so it costs only its own row. CSV records (`csv_records.py`) use the same
stand-ins and the same check (`decode_line`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokenmill.connectors.decoding import UTF8, Decoding, UndecodableText, to_utf8

# fsspec's readline re-reads a whole block per line; reading big chunks and splitting
# them ourselves is fast on every filesystem and keeps memory at one chunk.
_CHUNK_BYTES = 1 << 20
# The longest line read (a JSONL row, an OpenAI batch request): far more than any model's
# context holds, and a bound on the memory one line can take. Longer lines are bad lines.
MAX_LINE_BYTES = 32 << 20
# A chunk of lines also ends at this many bytes, so its memory does not grow with the
# number of lines asked for.
MAX_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class LineChunk:
    """Consecutive non-blank lines of a file with their 1-based line numbers."""

    line_numbers: list[int]
    lines: list[bytes]
    # With on_decode_error="replace": which lines had undecodable bytes replaced.
    replaced: list[bool] | None = None


class BadLine(ValueError):
    """One line that cannot become a row; `message` never contains the line's content.

    `unit` names what `line_number` counts: "line" in text files, "row index" (0-based)
    in Parquet.
    """

    def __init__(self, line_number: int, message: str, *, unit: str = "line"):
        super().__init__(f"{unit} {line_number}: {message}")
        self.line_number = line_number
        self.message = message


def iter_lines(
    fileobj,
    max_line_bytes: int | None = None,
    on_blank: Callable[[int], None] | None = None,
    first_line: int = 0,
) -> Iterator[tuple[int, bytes]]:
    """Yields `(line_number, line)` for each non-blank line, without the newline.

    A line longer than `max_line_bytes` (default MAX_LINE_BYTES) is not kept: it comes
    out as an `OversizedLine` placeholder, which `parse_object` reports as a bad line,
    so memory stays at one chunk plus one line however long a line is. A blank line
    (only whitespace, `\r` included: JSON's whitespace) is skipped, and `on_blank` is
    called with the number of lines yielded before it. Lines are numbered from
    `first_line` + 1 (`first_line`: the lines of the file before this stream's).
    """
    limit = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes
    number, yielded = first_line, 0
    line = _LineBuffer(limit)
    while True:
        chunk = fileobj.read(_CHUNK_BYTES)
        if not chunk:
            break
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            number += 1
            line.add(piece)
            text = line.take()
            if text.strip() or isinstance(text, OversizedLine):
                yield number, text
                yielded += 1
            elif on_blank is not None:
                on_blank(yielded)
        line.add(pieces[-1])
    text = line.take()
    if text.strip() or isinstance(text, OversizedLine):
        yield number + 1, text
    elif text and on_blank is not None:  # whitespace after the last newline: a blank line
        on_blank(yielded)


class OversizedLine(bytes):
    """Stands in for a line over the limit; its few bytes are never valid JSON or CSV."""

    def __new__(cls, size: int) -> OversizedLine:
        placeholder = super().__new__(cls, b"\x00oversized line")
        placeholder.size = size
        return placeholder


class UndecodableLine(bytes):
    """Stands in for a line whose bytes are not valid text; `message` says why."""

    def __new__(cls, message: str) -> UndecodableLine:
        placeholder = super().__new__(cls, b"\x00undecodable line")
        placeholder.message = message
        return placeholder


def decode_line(line: bytes, decoding: Decoding) -> tuple[bytes, bool]:
    """A line of an `open_decoded` stream as valid UTF-8.

    Returns:
        `(line, is_replaced)`; a line that cannot be decoded comes back as an
        `UndecodableLine` (and an `OversizedLine` as it is).
    """
    if isinstance(line, OversizedLine):
        return line, False
    try:
        return to_utf8(line, decoding)
    except UndecodableText as exc:
        return UndecodableLine(str(exc)), False


class _LineBuffer:
    """The pieces of the line being read; forgets them once they pass the limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pieces: list[bytes] = []
        self.size = 0

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size <= self.limit:
            self.pieces.append(piece)
        else:
            self.pieces = []  # the line is too long: keep counting, not storing

    def take(self) -> bytes:
        text = OversizedLine(self.size) if self.size > self.limit else b"".join(self.pieces)
        self.pieces, self.size = [], 0
        return text


def iter_line_chunks(
    fileobj,
    max_lines: int,
    decoding: Decoding = UTF8,
    on_blank: Callable[[int], None] | None = None,
    first_line: int = 0,
) -> Iterator[LineChunk]:
    """Groups non-blank lines, decoded (`decode_line`), into chunks of at most
    `max_lines` lines (and about MAX_CHUNK_BYTES); blank ones go to `on_blank` and
    lines are numbered as in `iter_lines`."""
    chunk = _ChunkBuilder(decoding)
    for number, line in iter_lines(fileobj, on_blank=on_blank, first_line=first_line):
        chunk.add(number, line)
        if len(chunk.lines) >= max_lines or chunk.size >= MAX_CHUNK_BYTES:
            yield chunk.take()
    if chunk.lines:
        yield chunk.take()


def head_lines(fileobj, max_bytes: int, decoding: Decoding = UTF8) -> LineChunk:
    """The first lines of a file totalling about `max_bytes` (always at least one line)."""
    chunk = _ChunkBuilder(decoding)
    for number, line in iter_lines(fileobj):
        chunk.add(number, line)
        if chunk.size >= max_bytes:
            break
    return chunk.take()


class _ChunkBuilder:
    def __init__(self, decoding: Decoding):
        self.decoding = decoding
        self.numbers: list[int] = []
        self.lines: list[bytes] = []
        self.replaced: list[bool] = []
        self.size = 0

    def add(self, number: int, line: bytes) -> None:
        line, is_replaced = decode_line(line, self.decoding)
        self.numbers.append(number)
        self.lines.append(line)
        self.replaced.append(is_replaced)
        self.size += len(line) + 1

    def take(self) -> LineChunk:
        replaced = self.replaced if self.decoding.replaces else None
        chunk = LineChunk(self.numbers, self.lines, replaced)
        self.numbers, self.lines, self.replaced, self.size = [], [], [], 0
        return chunk
