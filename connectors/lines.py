"""Line-oriented reading shared by the JSON Lines formats."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# fsspec's readline re-reads a whole block per line; reading big chunks and splitting
# them ourselves is fast on every filesystem and keeps memory at one chunk.
_CHUNK_BYTES = 1 << 20
# The longest line read (a JSONL row, an OpenAI batch request): far more than any model's
# context holds, and a bound on the memory one line can take. Longer lines are bad lines.
MAX_LINE_BYTES = 32 << 20


@dataclass(frozen=True)
class LineChunk:
    """Consecutive non-blank lines of a file with their 1-based line numbers."""

    line_numbers: list[int]
    lines: list[bytes]


class BadLine(ValueError):
    """One line that cannot become a row; `message` never contains the line's content."""

    def __init__(self, line_number: int, message: str):
        super().__init__(f"line {line_number}: {message}")
        self.line_number = line_number
        self.message = message


def iter_lines(fileobj, max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Yields `(line_number, line)` for each non-blank line, without the newline.

    A line longer than `max_line_bytes` (default MAX_LINE_BYTES) is not kept: it comes
    out as an `OversizedLine` placeholder, which `parse_object` reports as a bad line,
    so memory stays at one chunk plus one line however long a line is.
    """
    limit = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes
    number = 0
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
        line.add(pieces[-1])
    text = line.take()
    if text.strip() or isinstance(text, OversizedLine):
        yield number + 1, text


class OversizedLine(bytes):
    """Stands in for a line over the limit; its few bytes are never valid JSON or CSV."""

    def __new__(cls, size: int) -> OversizedLine:
        placeholder = super().__new__(cls, b"\x00oversized line")
        placeholder.size = size
        return placeholder


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


def iter_line_chunks(fileobj, max_lines: int) -> Iterator[LineChunk]:
    """Groups non-blank lines into chunks of at most `max_lines` lines."""
    numbers: list[int] = []
    lines: list[bytes] = []
    for number, line in iter_lines(fileobj):
        numbers.append(number)
        lines.append(line)
        if len(lines) >= max_lines:
            yield LineChunk(numbers, lines)
            numbers, lines = [], []
    if lines:
        yield LineChunk(numbers, lines)


def head_lines(fileobj, max_bytes: int) -> LineChunk:
    """The first lines of a file totalling about `max_bytes` (always at least one line)."""
    numbers: list[int] = []
    lines: list[bytes] = []
    size = 0
    for number, line in iter_lines(fileobj):
        numbers.append(number)
        lines.append(line)
        size += len(line) + 1
        if size >= max_bytes:
            break
    return LineChunk(numbers, lines)
