"""JSON Lines: pyarrow's parser per chunk, Python's per line when pyarrow refuses."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    REPLACED_COLUMN,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.lines import (
    MAX_LINE_BYTES,
    BadLine,
    LineChunk,
    OversizedLine,
    UndecodableLine,
    head_lines,
    iter_line_chunks,
)

_FLAG_COLUMNS = (ERROR_COLUMN, REPLACED_COLUMN)

# JSON can spell a lone UTF-16 surrogate ("\\ud800"); no UTF-8 text can hold one.
UNPAIRED_SURROGATE = "text with an unpaired surrogate escape such as \\ud800 (not valid Unicode)"


class JsonlReader:
    """Reads JSON Lines through any fsspec filesystem, decompressing by suffix."""

    # Types were only guessed from a sample: disagreeing files fall back to strings.
    conflicts_to_string = True

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with open_text_stream(fs, path, head=True) as f:
            sample = head_lines(open_decoded(f, options.decoding), options.sample_bytes)
        rows = []
        for number, line in zip(sample.line_numbers, sample.lines):
            try:
                rows.append(parse_object(line, number))
            except BadLine:
                # A bad line in the sample fails validation now, unless it may become a row.
                if options.on_bad_line == "error":
                    raise
        if options.schema is not None:
            return FileHead(schema=options.schema)
        return FileHead(schema=infer_schema(rows))

    def iter_batches(
        self, fs, path: str, schema: pa.Schema, *, name: str, options: ReadOptions
    ) -> Iterator[pa.RecordBatch]:
        data_schema = pa.schema([f for f in schema if f.name not in _FLAG_COLUMNS])
        with open_text_stream(fs, path) as f:
            lines = open_decoded(f, options.decoding)
            for chunk in iter_line_chunks(lines, options.batch_size, options.decoding):
                yield read_chunk(
                    chunk,
                    data_schema,
                    name=name,
                    on_bad_line=options.on_bad_line,
                    text_columns=options.text_columns,
                )


def parse_object(line: bytes, number: int) -> dict[str, Any]:
    """Parses one line that must hold a JSON object; raises `BadLine` otherwise."""
    if isinstance(line, OversizedLine):
        raise BadLine(
            number,
            f"longer than the line limit of {MAX_LINE_BYTES >> 20} MiB ({line.size:,} bytes)",
        )
    if isinstance(line, UndecodableLine):
        raise BadLine(number, line.message)
    try:
        value = json.loads(line)
    except UnicodeDecodeError:
        raise BadLine(number, "not valid UTF-8") from None
    except json.JSONDecodeError as e:
        # e.msg and e.colno describe the syntax error without echoing the line itself.
        raise BadLine(number, f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        hint = " (JSON arrays are not read; write one object per line)" if number == 1 else ""
        raise BadLine(number, f"expected a JSON object, got {type(value).__name__}{hint}")
    return value


def infer_schema(rows: Sequence[dict[str, Any]]) -> pa.Schema:
    """Column types from sample rows; a column whose values disagree becomes a string.

    Args:
        rows: parsed sample objects; field order is the order keys first appear.

    Returns:
        A schema; columns whose type the sample cannot tell (all null, only empty
        lists or objects) are strings holding each value's JSON text.
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    fields = []
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            dtype = pa.array(values).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
            dtype = pa.string()
        if _is_undetermined(dtype):
            dtype = pa.string()
        fields.append(pa.field(name, dtype))
    return pa.schema(fields)


def _is_undetermined(dtype: pa.DataType) -> bool:
    # Only nulls, `[]` or `{}` were seen: any later real value would not fit, so the
    # column keeps each value's JSON text instead.
    if pa.types.is_null(dtype):
        return True
    if pa.types.is_struct(dtype):
        return dtype.num_fields == 0 or any(_is_undetermined(f.type) for f in dtype)
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return _is_undetermined(dtype.value_type)
    return False


def read_chunk(
    chunk: LineChunk,
    schema: pa.Schema,
    *,
    name: str,
    on_bad_line: str,
    text_columns: frozenset[str] = frozenset(),
) -> pa.RecordBatch:
    """One chunk of lines as a batch of `schema` (plus `__error__` when a line failed,
    and `__replaced__` when a line's bytes were replaced)."""
    return with_replaced(
        _read_chunk(chunk, schema, name=name, on_bad_line=on_bad_line, text_columns=text_columns),
        chunk.replaced,
    )


def _read_chunk(
    chunk: LineChunk,
    schema: pa.Schema,
    *,
    name: str,
    on_bad_line: str,
    text_columns: frozenset[str],
) -> pa.RecordBatch:
    try:
        table = pa_json.read_json(
            io.BytesIO(b"\n".join(chunk.lines)),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=_block_size(chunk)),
            parse_options=pa_json.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            ),
        )
        if table.num_rows == len(chunk.lines):
            return table.combine_chunks().to_batches()[0] if table.num_rows else _empty(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        pass
    # pyarrow rejects a whole chunk for one odd value; redo it line by line to keep the
    # good rows, coerce what can be coerced and name the lines that cannot.
    return _read_chunk_python(
        chunk, schema, name=name, on_bad_line=on_bad_line, text_columns=text_columns
    )


def _read_chunk_python(
    chunk: LineChunk,
    schema: pa.Schema,
    *,
    name: str,
    on_bad_line: str,
    text_columns: frozenset[str],
) -> pa.RecordBatch:
    rows: list[dict[str, Any] | None] = []
    errors: list[str | None] = []
    for number, line in zip(chunk.line_numbers, chunk.lines):
        try:
            rows.append(parse_object(line, number))
            errors.append(None)
        except BadLine as e:
            _fail_or_record(e, name, on_bad_line, rows, errors)
    # A row that failed to parse, or holds a value its column cannot take, is nulled
    # as a whole (no half-parsed data); a non-text value in a text column only nulls
    # that value, so the row keeps its id for the error row it becomes.
    nulled = [e is not None for e in errors]
    columns = []
    for field in schema:
        text_only = field.name in text_columns
        values = [None if row is None else row.get(field.name) for row in rows]
        column, bad = to_arrow(values, field, text_only=text_only)
        for index in bad:
            error = BadLine(chunk.line_numbers[index], f"column {field.name!r}: {bad[index]}")
            if on_bad_line == "error":
                raise error
            errors[index] = errors[index] or f"{name}: {error}"
            nulled[index] = nulled[index] or not text_only
        columns.append(column)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    if not any(errors):
        return batch
    is_bad = pa.array(nulled)
    nulls = [pa.nulls(batch.num_rows, f.type) for f in schema]
    columns = [pc.if_else(is_bad, n, c) for n, c in zip(nulls, batch.columns)]
    return pa.RecordBatch.from_arrays(
        [*columns, pa.array(errors, pa.string())], names=[*schema.names, ERROR_COLUMN]
    )


def _fail_or_record(error: BadLine, name: str, on_bad_line: str, rows, errors) -> None:
    if on_bad_line == "error":
        raise error
    rows.append(None)
    errors.append(f"{name}: {error}")


def to_arrow(
    values: list[Any], field: pa.Field, *, text_only: bool = False
) -> tuple[pa.Array, dict[int, str]]:
    """Converts Python values to `field`'s type.

    Args:
        values: one value per row (None for missing).
        field: the target field.
        text_only: for a string field, a non-string value is bad rather than kept as
            its JSON spelling (a prompt of 42 is an error, not the text "42").

    Returns:
        `(array, bad)`: `bad` maps row index to why that value did not fit (such
        values are null in `array`). Messages never include the value itself.
    """
    if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
        if text_only:
            bad = {
                i: f"a {type(v).__name__} value where text was expected"
                for i, v in enumerate(values)
                if v is not None and not isinstance(v, str)
            }
            text = [None if i in bad else v for i, v in enumerate(values)]
            try:
                return pa.array(text, type=field.type), bad
            except UnicodeEncodeError:
                unpaired = {i: UNPAIRED_SURROGATE for i, v in enumerate(text) if _is_unpaired(v)}
                text = [None if i in unpaired else v for i, v in enumerate(text)]
                return pa.array(text, type=field.type), {**bad, **unpaired}
        # Anything else fits a string column: non-strings keep their JSON spelling.
        values = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
    if pa.types.is_integer(field.type):
        # pa.array truncates 1.5 to 1 without a word; a fraction is a bad value here.
        lossy = {
            i: f"a float value does not fit type {field.type}"
            for i, v in enumerate(values)
            if isinstance(v, float) and not v.is_integer()
        }
        if lossy:
            rest, bad = to_arrow([None if i in lossy else v for i, v in enumerate(values)], field)
            return rest, {**lossy, **bad}
    try:
        return pa.array(values, type=field.type), {}
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, UnicodeEncodeError):
        pass
    if all(v is None or isinstance(v, str) for v in values):
        # Timestamps and decimals arrive as strings; Arrow's cast parses them.
        try:
            return pa.array(values, pa.string()).cast(field.type), {}
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    good: list[Any] = []
    bad: dict[int, str] = {}
    for index, value in enumerate(values):
        try:
            pa.array([value], type=field.type)
            good.append(value)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            good.append(None)
            bad[index] = f"a {type(value).__name__} value does not fit type {field.type}"
        except UnicodeEncodeError:
            good.append(None)
            bad[index] = UNPAIRED_SURROGATE
    if len(bad) == len(values):
        return pa.nulls(len(values), field.type), bad
    try:
        return pa.array(good, type=field.type), bad
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # Strings that only parse through a cast (timestamps) and other stragglers.
        return pa.nulls(len(values), field.type), dict.fromkeys(
            range(len(values)), f"value does not fit type {field.type}"
        )


def _is_unpaired(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _block_size(chunk: LineChunk) -> int:
    # pyarrow needs each line to fit in one block; give it the whole chunk.
    return max(1 << 16, sum(len(line) + 1 for line in chunk.lines) + 1)


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)
