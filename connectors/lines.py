"""Line-oriented reading shared by the JSON Lines formats."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# fsspec's readline re-reads a whole block per line; reading big chunks and splitting
# them ourselves is fast on every filesystem and keeps memory at one chunk.
_CHUNK_BYTES = 1 << 20


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


def iter_lines(fileobj) -> Iterator[tuple[int, bytes]]:
    """Yields `(line_number, line)` for each non-blank line, without the newline."""
    number = 0
    rest = b""
    while True:
        chunk = fileobj.read(_CHUNK_BYTES)
        if not chunk:
            break
        pieces = (rest + chunk).split(b"\n")
        rest = pieces.pop()
        for piece in pieces:
            number += 1
            if piece.strip():
                yield number, piece
    if rest.strip():
        yield number + 1, rest


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
