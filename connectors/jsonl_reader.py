"""JSON Lines: pyarrow's parser per chunk, Python's per line when pyarrow refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    REPLACED_COLUMN,
    BlankTally,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.json_types import (
    chunks_covering,
    fits_type,
    infer_schema,
    is_nested,
    read_objects,
    settle_types,
)
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

# Python's JSON parser recurses, and gives up near 1,000 levels (a RecursionError).
DEEP_JSON = "JSON nested too deep to read (about 1,000 levels)"
# JSON can spell a lone UTF-16 surrogate ("\\ud800"); no UTF-8 text can hold one.
UNPAIRED_SURROGATE = "text with an unpaired surrogate escape such as \\ud800 (not valid Unicode)"


class JsonlReader:
    """Reads JSON Lines through any fsspec filesystem, decompressing by suffix."""

    # Types were only guessed from a sample: disagreeing files fall back to strings.
    conflicts_to_string = True

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with open_text_stream(fs, path, head=True) as f:
            return self.head_of(open_decoded(f, options.decoding), options)

    def head_of(self, stream, options: ReadOptions) -> FileHead:
        """`head` for an `open_decoded` stream."""
        sample = head_lines(stream, options.sample_bytes, options.decoding)
        if not sample.lines:  # no bytes, or blank lines only
            return FileHead(
                schema=options.schema or pa.schema([]), is_empty=True, is_whole_file=True
            )
        # `head_lines` stops once it has the sample's bytes: a sample short of them is the file.
        whole = sum(len(line) + 1 for line in sample.lines) < options.sample_bytes
        rows = []
        for number, line in zip(sample.line_numbers, sample.lines):
            try:
                rows.append(parse_object(line, number))
            except BadLine:
                # A bad line in the sample fails validation now, unless it may become a row.
                if options.on_bad_line == "error":
                    raise
        hint = list_in_one_object(rows)
        schema = options.schema if options.schema is not None else infer_schema(rows)
        return FileHead(schema=schema, hint=hint, is_whole_file=whole)

    def scan_types(
        self,
        fs,
        path: str,
        columns: Mapping[str, pa.DataType | None],
        *,
        options: ReadOptions,
        max_rows: int | None = None,
    ) -> dict[str, pa.DataType]:
        """`settle_types` over the file's lines (json_types.py): the types that hold every
        value of `columns`, from the first `max_rows` lines (None: all of them)."""
        with open_text_stream(fs, path) as f:
            return self.scan_types_of(open_decoded(f, options.decoding), columns, options, max_rows)

    def scan_types_of(
        self,
        stream,
        columns: Mapping[str, pa.DataType | None],
        options: ReadOptions,
        max_rows: int | None = None,
    ) -> dict[str, pa.DataType]:
        """`scan_types` for an `open_decoded` stream."""
        chunks = iter_line_chunks(stream, options.batch_size, options.decoding)
        return settle_types(chunks_covering((c.lines for c in chunks), max_rows), columns)

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
            yield from self.batches_of(
                open_decoded(f, options.decoding), schema, name=name, options=options, blanks=blanks
            )

    def batches_of(
        self,
        stream,
        schema: pa.Schema,
        *,
        name: str,
        options: ReadOptions,
        blanks: BlankTally | None = None,
        first_line: int = 0,
    ) -> Iterator[pa.RecordBatch]:
        """`iter_batches` for an `open_decoded` stream (whose first line is the file's
        line `first_line` + 1: `connectors/partitions.py` reads ranges of a file)."""
        data_schema = pa.schema([f for f in schema if f.name not in _FLAG_COLUMNS])
        # One row per line: the lines yielded before a blank one are the rows before it.
        on_blank = blanks.add if blanks is not None else None
        for chunk in iter_line_chunks(
            stream, options.batch_size, options.decoding, on_blank, first_line=first_line
        ):
            yield read_chunk(
                chunk,
                data_schema,
                name=name,
                on_bad_line=options.on_bad_line,
                text_columns=options.text_columns,
            )


def list_in_one_object(rows: Sequence[dict[str, Any]]) -> str | None:
    """What to tell a user whose columns are missing from a file of one object holding a
    list of objects (`{"data": [{...}, ...]}`): that the rows are inside it."""
    if len(rows) != 1:
        return None
    keys = [k for k, v in rows[0].items() if isinstance(v, list) and v and isinstance(v[0], dict)]
    if len(keys) != 1:
        return None
    return list_under_key_hint(keys[0])


def list_under_key_hint(key: str) -> str:
    path = f".{key}" if key.isidentifier() else f".[{json.dumps(key)}]"
    return (
        f"the file is one JSON object holding its rows as a list under {key!r}: tokenmill "
        "reads JSON Lines or a top-level JSON array of objects; write the list itself "
        f"(e.g. jq '{path}' in.json > rows.json)"
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
    except RecursionError:
        # Python's parser gives up near 1,000 levels; such a line is that row's error.
        raise BadLine(number, DEEP_JSON) from None
    if not isinstance(value, dict):
        hint = ""
        if number == 1 and isinstance(value, list):
            hint = " (a JSON array: a .json file, or --format json, reads its elements as rows)"
        raise BadLine(number, f"expected a JSON object, got {type(value).__name__}{hint}")
    return value


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
    batch = arrow_rows(chunk.lines, schema)
    if batch is not None:
        return batch
    # pyarrow rejects a whole chunk for one odd value; redo it line by line to keep the
    # good rows, coerce what can be coerced and name the lines that cannot.
    return _read_chunk_python(
        chunk, schema, name=name, on_bad_line=on_bad_line, text_columns=text_columns
    )


def arrow_rows(
    objects: Sequence[bytes], schema: pa.Schema, *, newlines_in_values: bool = False
) -> pa.RecordBatch | None:
    """JSON objects (one per item) as a batch of `schema`, parsed by pyarrow in one go;
    None when pyarrow refuses any of them, or when an object holds a key its nested
    column's type lacks (then each must be parsed on its own, and such a key is named).

    Args:
        objects: each one JSON object's bytes.
        schema: the batch's columns; other top-level fields are not read.
        newlines_in_values: objects may hold line breaks (pretty-printed array elements).
    """
    nested = [f for f in schema if is_nested(f.type)]
    try:
        # "ignore" would drop a nested key the type lacks without a word; "infer" adds it
        # to the column's type, which then differs from the schema's. Flat columns have no
        # such keys, and their chunks skip the inference.
        table = read_objects(
            objects,
            schema,
            unexpected="infer" if nested else "ignore",
            newlines_in_values=newlines_in_values,
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError):
        return None
    if table.num_rows != len(objects):
        return None
    if any(table.schema.field(f.name).type != f.type for f in nested):
        return None
    table = table.select(schema.names)
    return table.combine_chunks().to_batches()[0] if table.num_rows else _empty(schema)


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
    return rows_to_batch(
        rows,
        errors,
        chunk.line_numbers,
        schema,
        name=name,
        on_bad_line=on_bad_line,
        text_columns=text_columns,
    )


def rows_to_batch(
    rows: list[dict[str, Any] | None],
    errors: list[str | None],
    numbers: Sequence[int],
    schema: pa.Schema,
    *,
    name: str,
    on_bad_line: str,
    text_columns: frozenset[str],
    unit: str = "line",
) -> pa.RecordBatch:
    """Parsed rows (None: one that could not be parsed, its message in `errors`) as a
    batch of `schema`, plus `__error__` when any row is bad.

    Args:
        rows: the parsed objects.
        errors: per row, the message of a row already bad (else None).
        numbers: per row, its line number (or what `unit` counts) for messages.
        schema: the batch's columns.
        name: the file, as messages name it.
        on_bad_line: "error" raises the first value that does not fit its column.
        text_columns: columns whose values must be text.
        unit: what `numbers` count ("line", "array index").
    """
    errors = list(errors)
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
            error = BadLine(numbers[index], f"column {field.name!r}: {bad[index]}", unit=unit)
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
    if is_nested(field.type):
        # pa.array drops an object's keys the struct lacks, and truncates a nested 1.5 to
        # 1, without a word: such a value is a bad value, named, instead.
        lost = {}
        for i, v in enumerate(values):
            problem = fits_type(v, field.type)
            if problem is not None:
                lost[i] = problem
        if lost:
            rest, bad = to_arrow([None if i in lost else v for i, v in enumerate(values)], field)
            return rest, {**lost, **bad}
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


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)
