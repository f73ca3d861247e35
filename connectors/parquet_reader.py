"""Parquet: schema and row count from the footer, rows streamed one batch at a time.

Text the job reads (`ReadOptions.decode_columns`: prompts, ids...) stored as binary is
decoded value by value by the job's encoding (`connectors/decoding.py`): such a column
is a string column of the Source, and a value that does not decode is a bad value
naming its row index - the row keeps its other values (its id) and carries the message.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    BlankTally,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.decoding import decode_binary
from tokenmill.connectors.lines import BadLine


class ParquetReader:
    """Reads Parquet through fsspec file objects, so any filesystem works."""

    # Parquet types are exact: two files disagreeing on a column is an error, not a guess.
    conflicts_to_string = False

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with fs.open(path, "rb") as f:
            # Only the footer is read here; it fails fast on truncated or non-Parquet bytes.
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
            fields = [_as_text(f) if f.name in options.decode_columns else f for f in schema]
            return FileHead(
                schema=pa.schema(fields), num_rows=meta.num_rows, is_empty=meta.num_rows == 0
            )

    def iter_batches(
        self,
        fs,
        path: str,
        schema: pa.Schema,
        *,
        name: str,
        options: ReadOptions,
        blanks: BlankTally | None = None,  # Parquet has no blank records
    ) -> Iterator[pa.RecordBatch]:
        with fs.open(path, "rb") as f:
            parquet_file = pq.ParquetFile(f)
            present = set(parquet_file.schema_arrow.names)
            # A file from before a column was added simply lacks it; the Source fills nulls.
            columns = [c for c in schema.names if c in present]
            start = 0
            for batch in parquet_file.iter_batches(batch_size=options.batch_size, columns=columns):
                yield decode_text(batch, start, name=name, options=options)
                start += batch.num_rows


def _is_binary(dtype: pa.DataType) -> bool:
    return (
        pa.types.is_binary(dtype)
        or pa.types.is_large_binary(dtype)
        or pa.types.is_fixed_size_binary(dtype)
    )


def _as_text(field: pa.Field) -> pa.Field:
    """A binary field as the string field its decoded values fill; others as they are."""
    if pa.types.is_large_binary(field.type):
        return field.with_type(pa.large_string())
    return field.with_type(pa.string()) if _is_binary(field.type) else field


def decode_text(
    batch: pa.RecordBatch, start: int, *, name: str, options: ReadOptions
) -> pa.RecordBatch:
    """`batch` with its binary `decode_columns` decoded (row indices count from `start`)."""
    errors: dict[int, str] = {}
    replaced = [False] * batch.num_rows if options.decoding.replaces else None
    for index, field in enumerate(batch.schema):
        if field.name not in options.decode_columns or not _is_binary(field.type):
            continue
        column = batch.column(index)
        if pa.types.is_fixed_size_binary(field.type):
            column = column.cast(pa.binary())
        decoded = decode_binary(column, options.decoding)
        for row, problem in decoded.errors.items():
            error = BadLine(start + row, f"column {field.name!r}: {problem}", unit="row index")
            if options.on_bad_line == "error":
                raise error
            errors.setdefault(row, f"{name}: {error}")
        if replaced is not None and decoded.replaced is not None:
            replaced = [a or b for a, b in zip(replaced, decoded.replaced)]
        batch = batch.set_column(index, _as_text(field), decoded.values)
    if errors:
        messages = [errors.get(i) for i in range(batch.num_rows)]
        batch = batch.append_column(ERROR_COLUMN, pa.array(messages, pa.string()))
    return with_replaced(batch, replaced)
