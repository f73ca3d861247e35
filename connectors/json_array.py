"""A top-level JSON array read element by element, never parsed whole.

A `.json` file of records is most often one array, `[{...}, {...}, ...]`, of any size.
`iter_elements` finds each element's bytes with a scan that does not parse them, so
memory is one read plus the element being collected, however large the file:

- the array opens with `[` and closes with `]`; elements are separated by `,`, with any
  JSON whitespace around them, and only whitespace may follow the `]`;
- an object or array element ends at its matching bracket, brackets inside strings not
  counted (a string ends at the next quote no backslash escapes); a string element at
  its closing quote; a number or literal at the next `,`, `]`, `}` or whitespace. A flat
  object - most records - is matched by one compiled pattern;
- an element over the limit comes out as an `OversizedLine` (its bytes counted, not
  kept), as an over-long JSON Lines line does.

A break in that structure - a missing comma, an unterminated string or array, bytes
after the closing `]` - raises `ArraySyntaxError` naming its byte offset: past it no
later element can be found for sure, so the read stops rather than guess. `parse_element`
parses one element's bytes (a syntax error inside one is an `ArraySyntaxError` too).
Offsets count the bytes of the UTF-8 stream read (a byte order mark dropped).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from tokenmill.connectors.errors import FileFormatError
from tokenmill.connectors.lines import MAX_LINE_BYTES, OversizedLine

_READ_BYTES = 1 << 20
_QUOTE, _BACKSLASH, _OPEN_BRACKET, _OPEN_BRACE = 0x22, 0x5C, 0x5B, 0x7B
_NOT_SPACE = re.compile(rb"[^ \t\r\n]")
_STRUCTURE = re.compile(rb'[\[\]{}"]')  # what matters inside a container, outside strings
_STRING_STOP = re.compile(rb'["\\]')
_SCALAR_END = re.compile(rb"[ \t\r\n,\]}]")
# An object holding no object or array, and a run of them with their commas: one match,
# in C, for many elements. Possessive, so bytes that are not such a run fail the match in
# linear time.
_FLAT = rb'\{(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+\}'
_FLAT_OBJECT = re.compile(_FLAT, re.S)
_FLAT_RUN = re.compile(_FLAT + rb"(?:[ \t\r\n]*+,[ \t\r\n]*+" + _FLAT + rb")*+", re.S)


class ArraySyntaxError(FileFormatError):
    """The array's JSON is broken at `offset` (a byte offset in the file)."""

    def __init__(self, offset: int, message: str):
        super().__init__(f"invalid JSON at byte {offset:,} ({message})")
        self.offset = offset


class Element(NamedTuple):
    """One array element: its 0-based index, its byte offset and its bytes (or an
    `OversizedLine` standing in for them)."""

    index: int
    offset: int
    data: bytes


def parse_element(element: Element) -> Any:
    """The element's JSON value; a syntax error in it is an `ArraySyntaxError` naming the
    byte where it was found. The bytes must be valid UTF-8 (`lines.decode_line`)."""
    try:
        return json.loads(element.data)
    except json.JSONDecodeError as exc:
        at = len(exc.doc[: exc.pos].encode("utf-8", "surrogatepass"))
        raise ArraySyntaxError(element.offset + at, exc.msg) from None


def iter_elements(fileobj, max_element_bytes: int | None = None) -> Iterator[Element]:
    """Yields the elements of the array `fileobj` holds, in order.

    Args:
        fileobj: a binary stream (`decoding.open_decoded`) whose first non-space byte
            is `[`.
        max_element_bytes: the largest element kept (default MAX_LINE_BYTES).

    Raises:
        ArraySyntaxError: the array's structure is broken (see the module docstring).
    """
    splitter = _Splitter(MAX_LINE_BYTES if max_element_bytes is None else max_element_bytes)
    while True:
        data = fileobj.read(_READ_BYTES)
        if not data:
            break
        yield from splitter.feed(data)
    splitter.finish()


class ValueScan:
    """Finds where one JSON value ends, across reads: its state is where it stopped."""

    def __init__(self) -> None:
        self.depth = 0  # open brackets
        self.in_string = False
        self.escaped = False  # inside a string, the last read ended on a backslash
        self.scalar = False  # a number or literal: it ends at a delimiter

    def start(self, first_byte: int) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.scalar = first_byte not in (_QUOTE, _OPEN_BRACKET, _OPEN_BRACE)

    def scan(self, data: bytes, i: int) -> int | None:
        """Where the value ends in `data` (exclusive), scanning on from `i`; None if it
        goes on past `data`. A scalar ends before its delimiter."""
        n = len(data)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped, i = False, i + 1
                    continue
                stop = _STRING_STOP.search(data, i)
                if stop is None:
                    return None
                i = stop.end()
                if data[stop.start()] == _BACKSLASH:
                    self.escaped = True  # the byte after it, in this read or the next
                    continue
                self.in_string = False
                if self.depth == 0:
                    return i
                continue
            if self.scalar:
                end = _SCALAR_END.search(data, i)
                return None if end is None else end.start()
            found = _STRUCTURE.search(data, i)
            if found is None:
                return None
            i = found.end()
            byte = data[found.start()]
            if byte == _QUOTE:
                self.in_string = True
            elif byte in (_OPEN_BRACKET, _OPEN_BRACE):
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None


# Where the splitter is between elements.
_OPEN, _FIRST, _NEXT, _AFTER, _IN, _CLOSED = range(6)


class _Splitter:
    """The scan's state between reads: where it is in the array, and the element so far."""

    def __init__(self, limit: int):
        self.limit = limit
        self.phase = _OPEN
        self.offset = 0  # the file offset of the current read's first byte
        self.value = ValueScan()
        self.index = 0  # the next element's
        self.start_offset = 0  # the current element's
        self.pieces: list[bytes] = []  # the current element's bytes from earlier reads
        self.size = 0

    def feed(self, data: bytes) -> list[Element]:
        out: list[Element] = []
        n = len(data)
        i = 0
        while i < n:
            if self.phase == _IN:
                end = self.value.scan(data, i)
                if end is None:
                    self._keep(data[i:])
                    break
                self._keep(data[i:end])
                out.append(self._element())
                self.phase, i = _AFTER, end
                continue
            found = _NOT_SPACE.search(data, i)
            if found is None:
                break
            i = found.start()
            byte = data[i : i + 1]
            if self.phase == _OPEN:
                if byte != b"[":
                    raise self._error(i, "expected '[' to open the array")
                self.phase, i = _FIRST, i + 1
            elif self.phase == _AFTER:
                if byte not in (b",", b"]"):
                    raise self._error(i, "expected ',' or ']' after an element")
                self.phase, i = (_NEXT if byte == b"," else _CLOSED), i + 1
            elif self.phase == _CLOSED:
                raise self._error(i, "data after the array's closing ']'")
            elif byte == b"]" and self.phase == _FIRST:
                self.phase, i = _CLOSED, i + 1
            elif byte in (b",", b"]"):
                raise self._error(i, "expected an element")
            else:
                i = self._begin(data, i, out)
        self.offset += n
        return out

    def finish(self) -> None:
        """At the end of the file: the array must be closed."""
        if self.phase == _IN and self.value.scalar:
            self.phase = _AFTER  # a number or literal ended by the end of the file
        if self.phase != _CLOSED:
            where = "in an element" if self.phase == _IN else "before the array's ']'"
            raise ArraySyntaxError(self.offset, f"the file ends {where}")

    def _begin(self, data: bytes, i: int, out: list[Element]) -> int:
        """Starts the element at `data[i]`; returns where scanning goes on."""
        self.start_offset = self.offset + i
        if data[i] == _OPEN_BRACE:
            run = _FLAT_RUN.match(data, i)
            if run is not None:
                out += self._flat_elements(data, i, run.end())
                self.phase = _AFTER
                return run.end()
        self.value.start(data[i])
        self.phase = _IN
        if data[i] == _QUOTE:
            self.value.in_string = True
            self._keep(data[i : i + 1])
            return i + 1
        return i

    def _flat_elements(self, data: bytes, start: int, end: int) -> list[Element]:
        """The elements of a run of flat objects, `data[start:end]`, all in this read."""
        spans = [m.span() for m in _FLAT_OBJECT.finditer(data, start, end)]
        first, offset, limit = self.index, self.offset, self.limit
        self.index += len(spans)
        return [
            Element(first + k, offset + a, data[a:b] if b - a <= limit else OversizedLine(b - a))
            for k, (a, b) in enumerate(spans)
        ]

    def _keep(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size <= self.limit:
            self.pieces.append(piece)
        else:
            self.pieces = []  # past the limit: keep counting, not storing

    def _element(self) -> Element:
        data = OversizedLine(self.size) if self.size > self.limit else b"".join(self.pieces)
        element = Element(self.index, self.start_offset, data)
        self.index += 1
        self.pieces, self.size = [], 0
        return element

    def _error(self, i: int, message: str) -> ArraySyntaxError:
        return ArraySyntaxError(self.offset + i, message)
