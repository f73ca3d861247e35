"""CSV: pyarrow's streaming reader, with types inferred from each file's first block."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.csv as pa_csv

from tokenmill.connectors.batches import ERROR_COLUMN, FileHead, ReadOptions, error_rows
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.lines import BadLine

_BLOCK_BYTES = 1 << 20


class CsvReader:
    """Reads CSV through any fsspec filesystem, decompressing by suffix.

    Rows with the wrong number of fields are bad lines. In "skip_row" mode they come
    back as error rows right after the batch they were met in (the streaming reader
    does not say where exactly). A value that does not fit the type inferred from the
    first block fails the file; pass `schema=` (e.g. strings) to read such data.
    """

    conflicts_to_string = True

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with open_text_stream(fs, path, head=True) as f:
            reader, _ = _open(f, options, options.schema, include=False)
            return FileHead(schema=reader.schema)

    def iter_batches(
        self, fs, path: str, schema: pa.Schema, *, name: str, options: ReadOptions
    ) -> Iterator[pa.RecordBatch]:
        data_schema = pa.schema([f for f in schema if f.name != ERROR_COLUMN])
        with open_text_stream(fs, path) as f:
            reader, invalid = _open(f, options, data_schema, include=True)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowInvalid:
                    if invalid and options.on_bad_line == "error":
                        raise _bad_line(invalid[-1]) from None
                    raise
                yield batch
                if invalid:
                    messages = [f"{name}: {_bad_line(row)}" for row in invalid]
                    yield error_rows(messages, data_schema)
                    invalid.clear()


def _open(f, options: ReadOptions, schema: pa.Schema | None, *, include: bool):
    """Opens a streaming reader (which parses the first block) and its bad-row log."""
    invalid: list[pa_csv.InvalidRow] = []

    def on_invalid_row(row: pa_csv.InvalidRow) -> str:
        invalid.append(row)
        return "skip" if options.on_bad_line == "skip_row" else "error"

    if schema is None:
        convert = pa_csv.ConvertOptions()
    else:
        convert = pa_csv.ConvertOptions(
            column_types={f.name: f.type for f in schema},
            include_columns=schema.names if include else None,
            # A column that only later files have is simply null in earlier ones.
            include_missing_columns=include,
        )
    try:
        reader = pa_csv.open_csv(
            f,
            read_options=pa_csv.ReadOptions(use_threads=False, block_size=_BLOCK_BYTES),
            parse_options=pa_csv.ParseOptions(invalid_row_handler=on_invalid_row),
            convert_options=convert,
        )
    except pa.ArrowInvalid:
        if invalid and options.on_bad_line == "error":
            raise _bad_line(invalid[-1]) from None
        raise
    return reader, invalid


def _bad_line(row: pa_csv.InvalidRow) -> BadLine:
    number = row.number if row.number is not None else -1
    return BadLine(number, f"expected {row.expected_columns} columns, got {row.actual_columns}")
