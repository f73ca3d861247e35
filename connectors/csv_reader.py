"""CSV and other delimited text: records split and decoded one by one (`csv_records`),
parsed by pyarrow in batches.

Splitting before parsing means no record depends on the reader's block size or on its
neighbours: a record whose bytes do not decode, that is over the size limit, that has
the wrong number of fields or a value that does not fit its column's type is a bad line
naming its line, and the rest of its batch is parsed. Types are inferred from the
records in each file's first `sample_bytes`; columns empty there are text.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.csv as pa_csv

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    REPLACED_COLUMN,
    BlankTally,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.csv_records import Dialect, count_breaks, iter_records
from tokenmill.connectors.decoding import Decoding, open_decoded
from tokenmill.connectors.errors import safe_arrow_message
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.lines import (
    MAX_CHUNK_BYTES,
    MAX_LINE_BYTES,
    BadLine,
    OversizedLine,
    UndecodableLine,
    decode_line,
)

# (line number, record bytes or a stand-in, whether bytes were replaced)
Record = tuple[int, bytes, bool]


class CsvReader:
    """Reads delimited text (RFC 4180 with a header line; comma-separated unless the
    format or the options say otherwise) through any fsspec filesystem, decompressing by
    suffix."""

    conflicts_to_string = True

    def __init__(self, delimiter: str = ","):
        self.delimiter = delimiter  # the format's own: `,` for csv, a tab for tsv

    def dialect(self, options: ReadOptions) -> Dialect:
        return Dialect(options.csv_delimiter or self.delimiter, options.csv_quote)

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        dialect = self.dialect(options)
        with open_text_stream(fs, path, head=True) as f:
            records = _decoded_records(f, options.decoding, dialect)
            header = _header(records, dialect)
            if header is None:  # no bytes, or blank lines only
                return FileHead(schema=options.schema or pa.schema([]), is_empty=True)
            sample: list[Record] = []
            size = 0
            for record in records:
                sample.append(record)
                size += len(record[1]) + 1
                if size >= options.sample_bytes:
                    break
        if not sample:
            _check_header_alone(header, dialect)
        hint = _delimiter_hint(header.names, dialect)
        if options.schema is not None:
            return FileHead(schema=options.schema, is_empty=not sample, hint=hint)
        table, bad = _parse_batch(sample, header.names, pa_csv.ConvertOptions(), dialect)
        if bad and options.on_bad_line == "error":
            raise bad[0]
        if table is None:
            schema = pa.schema([(n, pa.string()) for n in header.names])
            return FileHead(schema=schema, is_empty=not sample, hint=hint)
        # A column with no value in the sample could hold anything later: text.
        fields = [
            pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in table.schema
        ]
        return FileHead(schema=pa.schema(fields), hint=hint)

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
        dialect = self.dialect(options)
        data_schema = pa.schema(
            [f for f in schema if f.name not in (ERROR_COLUMN, REPLACED_COLUMN)]
        )
        convert = pa_csv.ConvertOptions(
            column_types={f.name: f.type for f in data_schema},
            include_columns=data_schema.names,
            # A column that only later files have is simply null in earlier ones.
            include_missing_columns=True,
        )
        with open_text_stream(fs, path) as f:
            records = _decoded_records(f, options.decoding, dialect, blanks)
            header = _header(records, dialect)
            if header is None:
                return
            for batch in _group(records, options.batch_size):
                table, bad = _parse_batch(batch, header.names, convert, dialect)
                if bad and options.on_bad_line == "error":
                    raise bad[0]
                errors = {b.index: f"{name}: {b}" for b in bad}
                replaced = [r[2] for r in batch] if options.decoding.replaces else None
                yield with_replaced(_in_place(table, errors, len(batch), data_schema), replaced)


class _BadRecord(BadLine):
    """A bad line that also knows its position in the batch it was read in."""

    def __init__(self, index: int, line_number: int, message: str):
        super().__init__(line_number, message)
        self.index = index


def _decoded_records(
    f, decoding: Decoding, dialect: Dialect, blanks: BlankTally | None = None
) -> Iterator[Record]:
    # A blank record's position counts records before it, the header among them: rows
    # are the records after the header.
    on_blank = None if blanks is None else (lambda position: blanks.add(max(0, position - 1)))
    for number, record in iter_records(
        open_decoded(f, decoding), dialect=dialect, on_blank=on_blank
    ):
        if record.isascii():  # most records; stand-ins are ASCII too and stay as they are
            yield number, record, False
        else:
            record, is_replaced = decode_line(record, decoding)
            yield number, record, is_replaced


@dataclass(frozen=True)
class _Header:
    names: list[str]
    line: int  # the line it starts on
    num_lines: int  # more than one: a quoted name holds a line break


def _header(records: Iterator[Record], dialect: Dialect) -> _Header | None:
    """The column names, from the first record (None: the file has no record at all); a
    header that cannot be read fails the file."""
    first = next(records, None)
    if first is None:
        return None
    number, record, _ = first
    problem = _stand_in_problem(record)
    if problem is not None:
        raise BadLine(number, f"the header is {problem}")
    header = record + b"\n"  # pyarrow reads a header-only file only if the line is ended
    num_lines = count_breaks(record) + 1
    try:
        names = pa_csv.read_csv(
            io.BytesIO(header),
            read_options=_read_options(header),
            parse_options=_parse_options(dialect),
        ).column_names
    except pa.ArrowInvalid:
        if num_lines > 1:
            raise _swallowed(number, num_lines, dialect) from None
        raise
    return _Header(names, number, num_lines)


def _check_header_alone(header: _Header, dialect: Dialect) -> None:
    """A header alone is an empty file - unless it spans lines: then a quote left open
    has most likely swallowed every record after it, which must not pass as empty."""
    if header.num_lines > 1:
        raise _swallowed(header.line, header.num_lines, dialect)


def _swallowed(line: int, num_lines: int, dialect: Dialect) -> BadLine:
    return BadLine(
        line,
        f"the header runs over {num_lines} lines and no record follows it: a quote left "
        f"open? (the quote character is {dialect.quote!r}; --csv-quote sets another)",
    )


# Delimiters a header read as one column may really have been written with.
_OTHER_DELIMITERS = (";", "\t", "|")


def _delimiter_hint(names: list[str], dialect: Dialect) -> str | None:
    """What to suggest when the columns asked for are not found: a header read as one
    column whose name holds another common delimiter was most likely written with it."""
    if len(names) != 1:
        return None
    found = [c for c in _OTHER_DELIMITERS if c != dialect.delimiter and c in names[0]]
    if not found:
        return None
    likely = max(found, key=names[0].count)
    return (
        f"the header reads as one column, {names[0]!r}: is the file {likely!r}-delimited? "
        f"Set the delimiter: --csv-delimiter {likely!r} (csv_delimiter= in Python)"
    )


def _group(records: Iterator[Record], max_records: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    size = 0
    for record in records:
        batch.append(record)
        size += len(record[1]) + 1
        if len(batch) >= max_records or size >= MAX_CHUNK_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _parse_batch(
    batch: list[Record], names: list[str], convert: pa_csv.ConvertOptions, dialect: Dialect
) -> tuple[pa.Table | None, list[_BadRecord]]:
    """The batch's good records as a table (in order; None if there are none) and its
    bad ones."""
    bad: list[_BadRecord] = []
    good: list[int] = []
    for index, (number, record, _) in enumerate(batch):
        problem = _stand_in_problem(record)
        if problem is None:
            good.append(index)
        else:
            bad.append(_BadRecord(index, number, problem))
    records = [batch[i][1] for i in good]
    try:
        table = _parse(records, names, convert, dialect)
    except _ParseError:
        # Only some records are bad: find them by halving, then parse the rest at once.
        failed = _find_failures(records, names, convert, dialect)
        bad += [_BadRecord(good[i], batch[good[i]][0], message) for i, message in failed.items()]
        good = [g for i, g in enumerate(good) if i not in failed]
        table = _parse([batch[i][1] for i in good], names, convert, dialect)
    bad.sort(key=lambda b: b.index)
    return table, bad


def _stand_in_problem(record: bytes) -> str | None:
    if isinstance(record, OversizedLine):
        limit = MAX_LINE_BYTES >> 20
        return f"longer than the record limit of {limit} MiB ({record.size:,} bytes)"
    if isinstance(record, UndecodableLine):
        return record.message
    return None


class _ParseError(ValueError):
    """pyarrow could not read these records as rows; the message never quotes them."""


def _parse(
    records: list[bytes], names: list[str], convert: pa_csv.ConvertOptions, dialect: Dialect
) -> pa.Table | None:
    """The records as rows (None for no records); raises `_ParseError` if any is bad."""
    if not records:
        return None
    invalid: list[pa_csv.InvalidRow] = []

    def on_invalid_row(row: pa_csv.InvalidRow) -> str:
        invalid.append(row)
        return "error"

    data = b"\n".join(records)
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data),
            read_options=_read_options(data, names),
            parse_options=_parse_options(dialect, on_invalid_row),
            convert_options=convert,
        )
    except pa.ArrowInvalid as exc:
        if invalid:
            row = invalid[-1]
            raise _ParseError(
                f"expected {row.expected_columns} columns, got {row.actual_columns}"
            ) from None
        raise _ParseError(_conversion_problem(str(exc), names)) from None
    if table.num_rows != len(records):
        # Records are split by the same rules pyarrow parses with; never a silent miscount.
        raise _ParseError(f"{len(records)} records read as {table.num_rows} rows")
    return table


def _find_failures(
    records: list[bytes],
    names: list[str],
    convert: pa_csv.ConvertOptions,
    dialect: Dialect,
    offset: int = 0,
) -> dict[int, str]:
    """Index -> why, for each record that cannot be parsed (found by halving)."""
    try:
        _parse(records, names, convert, dialect)
        return {}
    except _ParseError as exc:
        if len(records) == 1:
            return {offset: str(exc)}
    middle = len(records) // 2
    return {
        **_find_failures(records[:middle], names, convert, dialect, offset),
        **_find_failures(records[middle:], names, convert, dialect, offset + middle),
    }


def _in_place(
    table: pa.Table | None, errors: dict[int, str], num_rows: int, schema: pa.Schema
) -> pa.RecordBatch:
    """The good rows with a row of nulls (and its message) wherever a bad record was."""
    if table is None:
        table = schema.empty_table()
    if errors:
        nulls = pa.table([pa.nulls(1, f.type) for f in schema], schema=schema)
        table = pa.concat_tables([table, nulls])
        null_row, indices, good = table.num_rows - 1, [], 0
        for index in range(num_rows):
            if index in errors:
                indices.append(null_row)
            else:
                indices.append(good)
                good += 1
        table = table.take(pa.array(indices, pa.int64()))
        messages = [errors.get(i) for i in range(num_rows)]
        table = table.append_column(ERROR_COLUMN, pa.array(messages, pa.string()))
    table = table.combine_chunks()
    return pa.RecordBatch.from_arrays(
        [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in table.columns],
        schema=table.schema,
    )


def _read_options(data: bytes, names: list[str] | None = None) -> pa_csv.ReadOptions:
    # The whole batch in one block: no record can straddle blocks.
    return pa_csv.ReadOptions(
        use_threads=False, block_size=max(1 << 16, len(data) + 1), column_names=names
    )


def _parse_options(dialect: Dialect, on_invalid_row=None) -> pa_csv.ParseOptions:
    # Records come split and joined by `\n`: line breaks left in them are inside quotes.
    return pa_csv.ParseOptions(
        delimiter=dialect.delimiter,
        quote_char=dialect.quote,
        newlines_in_values=True,
        invalid_row_handler=on_invalid_row,
    )


_CONVERSION = re.compile(r"column #(\d+).*conversion error to ([^:]+)", re.S)


def _conversion_problem(message: str, names: list[str]) -> str:
    """pyarrow's conversion error, naming the column and type but never the value."""
    found = _CONVERSION.search(message)
    if found is not None and int(found.group(1)) < len(names):
        return f"column {names[int(found.group(1))]!r}: value does not fit type {found.group(2)}"
    return safe_arrow_message(message)
