"""Parquet: schema and row count from the footer, rows streamed one batch at a time."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.connectors.batches import FileHead, ReadOptions


class ParquetReader:
    """Reads Parquet through fsspec file objects, so any filesystem works."""

    # Parquet types are exact: two files disagreeing on a column is an error, not a guess.
    conflicts_to_string = False

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with fs.open(path, "rb") as f:
            # Only the footer is read here; it fails fast on truncated or non-Parquet bytes.
            meta = pq.ParquetFile(f).metadata
            return FileHead(schema=meta.schema.to_arrow_schema(), num_rows=meta.num_rows)

    def iter_batches(
        self, fs, path: str, schema: pa.Schema, *, name: str, options: ReadOptions
    ) -> Iterator[pa.RecordBatch]:
        with fs.open(path, "rb") as f:
            parquet_file = pq.ParquetFile(f)
            present = set(parquet_file.schema_arrow.names)
            # A file from before a column was added simply lacks it; the Source fills nulls.
            columns = [c for c in schema.names if c in present]
            yield from parquet_file.iter_batches(batch_size=options.batch_size, columns=columns)
