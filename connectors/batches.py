"""The shapes passed between a Source and its per-format readers, and batch helpers."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

from tokenmill.connectors.decoding import UTF8, Decoding

# Rows that could not be parsed carry their message here (null for good rows) when
# `on_bad_line="skip_row"`, so downstream turns them into error rows instead of losing them.
ERROR_COLUMN = "__error__"

# With on_decode_error="replace": true for a row whose bytes did not all decode and were
# replaced by U+FFFD (null or absent: nothing was replaced).
REPLACED_COLUMN = "__replaced__"

OnBadLine = Literal["error", "skip_row"]
ON_BAD_LINE = ("error", "skip_row")


@dataclass(frozen=True)
class ReadOptions:
    """What every reader needs to know, fixed once per Source."""

    batch_size: int
    on_bad_line: OnBadLine = "error"
    # A user-given schema for formats that infer one (JSONL, CSV).
    schema: pa.Schema | None = None
    # How much of a text file's head is read to infer its schema.
    sample_bytes: int = 1 << 20
    # Columns whose values must be text (prompts): a number or object there is a bad
    # value, not JSON text to pass on.
    text_columns: frozenset[str] = frozenset()
    # How bytes become text, and what an undecodable row becomes.
    decoding: Decoding = UTF8
    # Columns the job reads as text (prompts, ids...): where a format stores them as
    # binary (Parquet), each value is decoded by `decoding` (one that does not decode
    # makes an error row).
    decode_columns: frozenset[str] = frozenset()
    # Delimited text: the field delimiter (None: the format's own, `,` or a tab) and quote.
    csv_delimiter: str | None = None
    csv_quote: str = '"'


@dataclass(frozen=True)
class FileHead:
    """What a reader learns from a file before reading its rows."""

    schema: pa.Schema
    num_rows: int | None = None
    # The file holds no record at all: no bytes, blank lines only, a header alone, an
    # empty array, no rows. With an empty `schema` it says nothing of the columns.
    is_empty: bool = False
    # What to tell a user whose columns are not in `schema` (the header looks like another
    # delimiter's, the rows are a list inside one object...).
    hint: str | None = None
    # The head read the whole file, so its inferred types are the file's (a reader with
    # `scan_types` need not scan it again).
    is_whole_file: bool = False


@dataclass
class ReadCounts:
    """What reading an input met: the rows handed on, and the blank records skipped (an
    empty CSV record, a JSON Lines line of whitespace) - every record the reader saw."""

    rows: int = 0
    blank: int = 0

    @property
    def records(self) -> int:
        return self.rows + self.blank


class BlankTally:
    """The blank records a reader skipped in one file, each at the row it came before.

    A reader calls `add(position)` with the number of rows it had yielded when it met a
    blank record; the Source then counts exactly those before the last row it hands on
    (`take_before`), so a `limit` that ends mid-batch counts only the blanks before it.
    Runs of blanks at one position are one entry: memory is bounded by a batch's rows.
    """

    def __init__(self) -> None:
        self._runs: deque[list[int]] = deque()  # [position, count], positions ascending

    def add(self, position: int, count: int = 1) -> None:
        if self._runs and self._runs[-1][0] == position:
            self._runs[-1][1] += count
        else:
            self._runs.append([position, count])

    def take_before(self, position: int) -> int:
        """The blanks recorded before row `position` (at positions < it), forgotten now."""
        taken = 0
        while self._runs and self._runs[0][0] < position:
            taken += self._runs.popleft()[1]
        return taken

    def take_all(self) -> int:
        """Every blank still recorded (the file was read to its end)."""
        taken = sum(count for _, count in self._runs)
        self._runs.clear()
        return taken


def unify(schemas: Sequence[pa.Schema], *, conflicts_to_string: bool) -> pa.Schema:
    """One schema for many files: missing fields become nullable, numbers promote.

    Args:
        schemas: per-file schemas, in file order (field order follows first appearance).
        conflicts_to_string: make a field whose types cannot be reconciled a string
            (for text formats, whose types were only guessed); otherwise raise.

    Returns:
        The unified schema without metadata; raises `pa.ArrowTypeError` on a conflict.
    """
    schemas = [s.remove_metadata() for s in schemas]
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        if not conflicts_to_string:
            raise
    fields: dict[str, pa.Field] = {}
    for schema in schemas:
        for field in schema:
            known = fields.get(field.name)
            if known is None:
                fields[field.name] = field
                continue
            try:
                merged = pa.unify_schemas(
                    [pa.schema([known]), pa.schema([field])], promote_options="permissive"
                )
                fields[field.name] = merged.field(0)
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                fields[field.name] = pa.field(field.name, pa.string())
    return pa.schema(list(fields.values()))


def conform(
    batch: pa.RecordBatch, schema: pa.Schema, constants: Mapping[str, Any] | None = None
) -> pa.RecordBatch:
    """Reshapes a batch to `schema`: reorders, casts, fills missing columns.

    Args:
        batch: a batch holding some of the schema's columns.
        schema: the target schema.
        constants: per-file values for columns the file itself lacks (hive partitions).

    Returns:
        A batch with exactly `schema`'s columns; absent ones are constants or nulls.
    """
    constants = constants or {}
    num_rows = batch.num_rows
    arrays = []
    for field in schema:
        index = batch.schema.get_field_index(field.name)
        if index >= 0:
            column = batch.column(index)
            arrays.append(column if column.type == field.type else column.cast(field.type))
        elif constants.get(field.name) is not None:
            arrays.append(pa.repeat(pa.scalar(constants[field.name], field.type), num_rows))
        else:
            arrays.append(pa.nulls(num_rows, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def rechunk(batches: Iterator[pa.RecordBatch], max_rows: int) -> Iterator[pa.RecordBatch]:
    """Splits batches larger than `max_rows` (slices are zero-copy); drops empty ones."""
    for batch in batches:
        for offset in range(0, batch.num_rows, max_rows):
            yield batch.slice(offset, max_rows)


def with_replaced(batch: pa.RecordBatch, replaced: Sequence[bool] | None) -> pa.RecordBatch:
    """`batch` with the REPLACED_COLUMN flags, when any row had bytes replaced."""
    if replaced is None or not any(replaced):
        return batch
    return batch.append_column(REPLACED_COLUMN, pa.array(replaced, pa.bool_()))


def error_rows(messages: Sequence[str], schema: pa.Schema) -> pa.RecordBatch:
    """Rows of nulls carrying only an error message, for lines that could not be parsed."""
    arrays = [pa.nulls(len(messages), f.type) for f in schema if f.name != ERROR_COLUMN]
    names = [f.name for f in schema if f.name != ERROR_COLUMN]
    return pa.RecordBatch.from_arrays(
        [*arrays, pa.array(messages, pa.string())], names=[*names, ERROR_COLUMN]
    )
