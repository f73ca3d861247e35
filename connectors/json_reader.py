"""`.json` input: a top-level JSON array of objects, streamed, or JSON Lines.

The first byte that is not whitespace tells which: `[` opens an array, whose elements
are read one by one (`json_array.py`) and parsed in batches as JSON Lines are; anything
else is JSON Lines (`jsonl_reader.py`). An array element that is not an object, or
whose values do not fit their columns, is an error row naming its index (`array index
7: expected a JSON object, got list`); a syntax error fails the read at its byte offset.

One object spread over lines (`{"data": [{...}, ...]}`, as APIs return rows) is neither:
it is refused, naming the key whose list holds the rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    REPLACED_COLUMN,
    BlankTally,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.errors import FileFormatError
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.json_array import (
    Element,
    ValueScan,
    iter_elements,
    parse_element,
)
from tokenmill.connectors.json_types import chunks_covering, infer_schema, settle_types
from tokenmill.connectors.jsonl_reader import (
    DEEP_JSON,
    JsonlReader,
    arrow_rows,
    list_under_key_hint,
    rows_to_batch,
)
from tokenmill.connectors.lines import (
    MAX_CHUNK_BYTES,
    MAX_LINE_BYTES,
    BadLine,
    OversizedLine,
    UndecodableLine,
    decode_line,
)

UNIT = "array index"  # how messages name an element: its 0-based index, as jq's .[7]
_SNIFF_BYTES = 1 << 20
_WHITESPACE = b" \t\r\n"


class JsonReader:
    """The `json` format: an array of objects or JSON Lines, told by the first byte."""

    conflicts_to_string = True

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with open_text_stream(fs, path, head=True) as f:
            first, stream = _sniff(open_decoded(f, options.decoding))
            if first == b"[":
                return _array_head(stream, options)
            if first == b"{":
                _refuse_one_object(stream.head)
            return JsonlReader().head_of(stream, options)

    def scan_types(
        self,
        fs,
        path: str,
        columns: Mapping[str, pa.DataType | None],
        *,
        options: ReadOptions,
        max_rows: int | None = None,
    ) -> dict[str, pa.DataType]:
        """The types that hold every value of `columns` in the file's first `max_rows`
        elements or lines (None: all of them); `json_types.settle_types`."""
        with open_text_stream(fs, path) as f:
            first, stream = _sniff(open_decoded(f, options.decoding))
            if first != b"[":
                return JsonlReader().scan_types_of(stream, columns, options, max_rows)
            chunks = (
                [decode_line(e.data, options.decoding)[0] for e in elements]
                for elements in _element_chunks(stream, options.batch_size)
            )
            return settle_types(chunks_covering(chunks, max_rows), columns, newlines_in_values=True)

    def iter_batches(
        self,
        fs,
        path: str,
        schema: pa.Schema,
        *,
        name: str,
        options: ReadOptions,
        blanks: BlankTally | None = None,
    ) -> Iterator[pa.RecordBatch]:
        with open_text_stream(fs, path) as f:
            first, stream = _sniff(open_decoded(f, options.decoding))
            if first == b"[":
                yield from _array_batches(stream, schema, name=name, options=options)
            else:
                yield from JsonlReader().batches_of(
                    stream, schema, name=name, options=options, blanks=blanks
                )


class _Replay:
    """A stream whose first bytes were read to sniff it: they are read again first."""

    def __init__(self, head: bytes, raw: Any):
        self.head = head
        self._pending = head
        self._raw = raw

    def read(self, size: int = -1) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        return self._raw.read(size)


def _sniff(stream: Any) -> tuple[bytes, _Replay]:
    """The first byte that is not whitespace (b"" for none), and the stream from its start."""
    head = b""
    while True:
        data = stream.read(_SNIFF_BYTES)
        head += data
        first = head.lstrip(_WHITESPACE)[:1]
        if first or not data or len(head) >= MAX_LINE_BYTES:
            return first, _Replay(head, stream)


def _array_head(stream: Any, options: ReadOptions) -> FileHead:
    rows: list[dict[str, Any]] = []
    size = num_elements = 0
    whole = True  # the sample reached the array's end
    for element in iter_elements(stream):
        num_elements += 1
        data, _ = decode_line(element.data, options.decoding)
        try:
            rows.append(_parse_row(element, data))
        except BadLine:
            if options.on_bad_line == "error":
                raise
        size += len(data)
        if size >= options.sample_bytes:
            whole = False
            break
    if not num_elements:  # `[]`
        return FileHead(schema=options.schema or pa.schema([]), is_empty=True, is_whole_file=True)
    return FileHead(schema=options.schema or infer_schema(rows), is_whole_file=whole)


def _refuse_one_object(head: bytes) -> None:
    """Raises `FileFormatError` when the file starts with one JSON object spread over
    lines: that is not JSON Lines, and its rows are most likely a list inside it."""
    start = len(head) - len(head.lstrip(_WHITESPACE))
    line_end = head.find(b"\n", start)
    if line_end < 0:
        return  # one line (so far): JSON Lines, whose reader judges it
    scan = ValueScan()
    scan.start(head[start])
    end = scan.scan(head, start)
    if end is not None:
        if end <= line_end:
            return  # the first object ends on its line: JSON Lines
        try:
            value = json.loads(head[start:end])
        except ValueError:
            return  # a broken first line, not an object over lines: a bad line
        keys = [k for k, v in value.items() if isinstance(v, list)]
    else:
        keys = _keys_holding_lists(head, start)
        if not keys:
            return  # not an object over lines that we can tell: JSON Lines' to judge
    if len(keys) == 1:
        raise FileFormatError(list_under_key_hint(keys[0]))
    raise FileFormatError(
        "the file is one JSON object spread over lines"
        + (f" (lists under {', '.join(map(repr, keys))})" if keys else "")
        + ": tokenmill reads JSON Lines (one object per line) or a top-level JSON array "
        "of objects"
    )


_KEY = re.compile(rb'[ \t\r\n]*"((?:[^"\\]|\\.)*+)"[ \t\r\n]*:[ \t\r\n]*', re.S)
_COMMA = re.compile(rb"[ \t\r\n]*,")


def _keys_holding_lists(head: bytes, start: int) -> list[str]:
    """The keys of the object at `head[start]` whose value is an array, as far as `head`
    holds the object (its values are skipped, not parsed)."""
    keys = []
    i = start + 1
    while True:
        key = _KEY.match(head, i)
        if key is None or key.end() >= len(head):
            return keys
        i = key.end()
        try:
            name = json.loads(b'"' + key.group(1) + b'"')
        except ValueError:
            return keys
        if head[i : i + 1] == b"[":
            keys.append(name)
        scan = ValueScan()
        scan.start(head[i])
        end = scan.scan(head, i)
        comma = None if end is None else _COMMA.match(head, end)
        if comma is None:
            return keys
        i = comma.end()


def _array_batches(
    stream: Any, schema: pa.Schema, *, name: str, options: ReadOptions
) -> Iterator[pa.RecordBatch]:
    data_schema = pa.schema([f for f in schema if f.name not in (ERROR_COLUMN, REPLACED_COLUMN)])
    for elements in _element_chunks(stream, options.batch_size):
        yield _array_batch(elements, data_schema, name=name, options=options)


def _element_chunks(stream: Any, max_elements: int) -> Iterator[list[Element]]:
    """The array's elements in chunks of at most `max_elements` (and about
    MAX_CHUNK_BYTES)."""
    elements: list[Element] = []
    size = 0
    for element in iter_elements(stream):
        elements.append(element)
        size += len(element.data)
        if len(elements) >= max_elements or size >= MAX_CHUNK_BYTES:
            yield elements
            elements, size = [], 0
    if elements:
        yield elements


def _array_batch(
    elements: list[Element], schema: pa.Schema, *, name: str, options: ReadOptions
) -> pa.RecordBatch:
    """Elements as rows: parsed by pyarrow in one go when it can, else one by one."""
    decoded = [decode_line(e.data, options.decoding) for e in elements]
    replaced = [r for _, r in decoded] if options.decoding.replaces else None
    batch = arrow_rows([d for d, _ in decoded], schema, newlines_in_values=True)
    if batch is None:
        rows: list[dict[str, Any] | None] = []
        errors: list[str | None] = []
        for element, (data, _) in zip(elements, decoded):
            try:
                rows.append(_parse_row(element, data))
                errors.append(None)
            except BadLine as exc:
                if options.on_bad_line == "error":
                    raise
                rows.append(None)
                errors.append(f"{name}: {exc}")
        batch = rows_to_batch(
            rows,
            errors,
            [e.index for e in elements],
            schema,
            name=name,
            on_bad_line=options.on_bad_line,
            text_columns=options.text_columns,
            unit=UNIT,
        )
    return with_replaced(batch, replaced)


def _parse_row(element: Element, data: bytes) -> dict[str, Any]:
    """One element (its bytes decoded by `decode_line`) as a row; `BadLine` naming its
    index when it cannot be one, `ArraySyntaxError` when its JSON is broken."""
    if isinstance(data, OversizedLine):
        limit = MAX_LINE_BYTES >> 20
        raise BadLine(
            element.index,
            f"longer than the element limit of {limit} MiB ({data.size:,} bytes)",
            unit=UNIT,
        )
    if isinstance(data, UndecodableLine):
        raise BadLine(element.index, data.message, unit=UNIT)
    try:
        value = parse_element(Element(element.index, element.offset, data))
    except RecursionError:
        # Python's parser gives up near 1,000 levels; such an element is its row's error.
        raise BadLine(element.index, DEEP_JSON, unit=UNIT) from None
    if not isinstance(value, dict):
        got = type(value).__name__ if value is not None else "null"
        raise BadLine(element.index, f"expected a JSON object, got {got}", unit=UNIT)
    return value
