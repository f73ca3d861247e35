"""`open_source`: a dataset URL validated up front, then streamed as record batches."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    ON_BAD_LINE,
    REPLACED_COLUMN,
    BlankTally,
    FileHead,
    OnBadLine,
    ReadCounts,
    ReadOptions,
    conform,
    rechunk,
    unify,
)
from tokenmill.connectors.csv_records import Dialect
from tokenmill.connectors.decoding import Decoding, OnDecodeError
from tokenmill.connectors.discovery import DataFiles, discover
from tokenmill.connectors.errors import (
    FileFormatError,
    SourceError,
    access_denied,
    safe_arrow_message,
)
from tokenmill.connectors.fingerprint import fingerprint_files
from tokenmill.connectors.formats import (
    DELIMITED_FORMATS,
    FORMATS,
    detect_format,
    get_reader,
    known_extensions,
    normalize_format,
)
from tokenmill.connectors.fs import display, redact_url, resolve, to_url
from tokenmill.connectors.json_types import finish_type, is_nested, widen
from tokenmill.connectors.lines import BadLine
from tokenmill.connectors.store_retries import store_operation

DEFAULT_BATCH_SIZE = 8192

# Errors that mean "these bytes are not what the format promises". Other OSErrors
# (network, throttling) pass through untouched so retry logic can see them.
PARSE_ERRORS = (ValueError, EOFError, gzip.BadGzipFile, zlib.error, pa.ArrowException)


@dataclass
class Source:
    """A validated input dataset. Build it with `open_source`.

    `schema` is what `iter_batches` yields; `files` are URLs in read order; `num_rows`
    is known without reading rows for Parquet (footers) and after `count_rows()`.
    `is_empty`: every file holds no record at all (no bytes, blank lines only, a header
    alone, `[]`, a Parquet file of no rows).
    """

    uri: str
    format: str
    files: list[str]
    schema: pa.Schema
    num_rows: int | None
    batch_size: int
    on_bad_line: OnBadLine
    is_empty: bool
    _fs: Any = field(repr=False, compare=False)
    _data: DataFiles = field(repr=False, compare=False)
    _read_schema: pa.Schema = field(repr=False, compare=False)
    _options: ReadOptions = field(repr=False, compare=False)

    def iter_batches(
        self, *, limit: int | None = None, counts: ReadCounts | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Streams the rows: every batch has `schema` and at most `batch_size` rows.

        Args:
            limit: stop after this many rows (None: read every file to its end).
            counts: filled in as the rows are yielded: the rows, and the blank records
                the readers skipped before the last row yielded (at the end of a file
                read whole, also those after its last row).

        Raises `SourceError` naming the file (and line, for JSONL and CSV) when bytes past
        the validated head turn out to be unreadable.
        """
        reader = get_reader(self.format)
        counts = counts if counts is not None else ReadCounts()
        taken = 0  # rows yielded by this call
        for path, constants in zip(self._data.paths, self._data.partitions):
            name = display(self._fs, path)
            blanks = BlankTally()
            batches = reader.iter_batches(
                self._fs, path, self._read_schema, name=name, options=self._options, blanks=blanks
            )
            file_rows = 0
            try:
                with store_operation("reading", name):
                    for batch in rechunk(batches, self.batch_size):
                        is_last = limit is not None and taken + batch.num_rows >= limit
                        if is_last:
                            batch = batch.slice(0, limit - taken)
                        file_rows += batch.num_rows
                        taken += batch.num_rows
                        counts.blank += blanks.take_before(file_rows)
                        counts.rows += batch.num_rows
                        if batch.num_rows:
                            yield conform(batch, self.schema, constants)
                        if is_last:
                            return
            except PARSE_ERRORS as e:
                raise_source_error(name, self.format, e)
            counts.blank += blanks.take_all()

    def fingerprint(self) -> list[dict[str, Any]]:
        """The input files' URLs, sizes and version stamps (`connectors/fingerprint.py`)."""
        return fingerprint_files(self._fs, self._data.paths)

    def to_table(self) -> pa.Table:
        """All rows at once; for small inputs and tests."""
        return pa.Table.from_batches(list(self.iter_batches()), schema=self.schema)

    def count_rows(self) -> int:
        """Reads every row once, so a bad line anywhere fails now, before any compute.

        Returns:
            The number of rows `iter_batches` yields; also stored in `num_rows`.
        """
        self.num_rows = sum(batch.num_rows for batch in self.iter_batches())
        return self.num_rows


def open_source(
    uri: str,
    *,
    format: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_bad_line: OnBadLine = "error",
    schema: pa.Schema | None = None,
    validate: Literal["head", "full"] = "head",
    text_columns: Sequence[str] = (),
    encoding: str = "utf-8",
    on_decode_error: OnDecodeError = "error-row",
    decode_columns: Sequence[str] = (),
    csv_delimiter: str | None = None,
    csv_quote: str = '"',
    json_text_columns: Sequence[str] = (),
    limit: int | None = None,
) -> Source:
    """Opens and validates an input dataset without reading its rows.

    Args:
        uri: a file, directory, glob or hive-partitioned dataset, on any fsspec
            filesystem (`s3://`, `gs://`, `memory://`, `http(s)://`, local paths).
        format: one of `FORMATS` ("parquet", "jsonl", "json", "csv", "tsv",
            "openai-batch"); None detects it from the file extensions (`.gz` and other
            compression suffixes are looked through).
        storage_options: filesystem options (credentials, `endpoint_url`); never shown.
        columns: the columns to read, in this order (partition columns included).
        batch_size: the most rows in one yielded batch.
        on_bad_line: "error" fails on a line that cannot be parsed; "skip_row" yields it
            as a row of nulls with a message in the `__error__` column.
        schema: column types for JSONL/CSV instead of inferring them from the first block.
        validate: "head" checks each file's footer or first block; "full" also reads
            every row once so that no bad line can surface mid-job.
        text_columns: columns that must hold text (e.g. prompts). In JSONL, where a
            column can mix types, a non-text value there is a bad value (an error row
            with "skip_row") instead of being kept as its JSON spelling.
        encoding: the text encoding of JSONL/CSV/OpenAI batch files and of binary
            values in `decode_columns` (any Python codec: latin-1, cp1252, utf-16...).
        on_decode_error: "error-row": a line (or binary value) that does not decode is a
            bad line, as `on_bad_line` says; "replace": its undecodable bytes become
            U+FFFD and the row is flagged in a `__replaced__` column.
        decode_columns: columns read as text: where a file stores one as binary
            (Parquet), its values are decoded by `encoding` and the column is a string.
        csv_delimiter: delimited text's field delimiter, one ASCII character (None: the
            format's own - a comma for csv, a tab for tsv).
        csv_quote: delimited text's quote character.
        json_text_columns: JSON columns read as each value's JSON text, every key kept
            and none added (a row's own JSON schema, where a key that is null is not a
            key that is absent, as it is in a struct).
        limit: only the first N rows of each file will be read (a job's limit): JSON
            column types are settled over those rows only (None: every row).

    JSON Lines and JSON arrays state no types: they are guessed from each file's first
    block, and the columns read that hold objects or lists, or that no first block
    showed, are settled over the whole file (`json_types.py`), so no key first seen late
    is dropped. With `columns=None` the columns are those the first blocks show.

    Returns:
        A `Source`; raises `SourceError` (a `ValueError`) naming the file and problem.
    """
    fmt = _check_options(format, on_bad_line, batch_size, columns, schema, validate, limit)
    decoding = Decoding(encoding, on_decode_error)
    Dialect(csv_delimiter or ",", csv_quote)  # a bad character is refused before any I/O
    fs, path = resolve(uri, storage_options)
    with store_operation("listing", redact_url(uri)):
        data = discover(fs, path)
    fmt = fmt or _detect(fs, path, data.paths)
    if schema is not None and fmt not in _TEXT_FORMATS:
        raise ValueError(f"schema= is only for {', '.join(_TEXT_FORMATS)} input, not {fmt}")
    if (csv_delimiter is not None or csv_quote != '"') and fmt not in DELIMITED_FORMATS:
        raise ValueError(
            f"csv_delimiter and csv_quote are for delimited text ({', '.join(DELIMITED_FORMATS)}), "
            f"not {fmt} input"
        )
    options = ReadOptions(
        batch_size=batch_size,
        on_bad_line=on_bad_line,
        schema=schema,
        text_columns=frozenset(text_columns),
        decoding=decoding,
        decode_columns=frozenset(decode_columns),
        csv_delimiter=csv_delimiter,
        csv_quote=csv_quote,
    )
    reader = get_reader(fmt)
    heads = [_read_head(reader, fs, p, fmt, options) for p in data.paths]
    name = redact_url(uri)
    # A file with no record and no header says nothing of the columns: it takes any.
    telling = [h for h in heads if not (h.is_empty and not len(h.schema))]
    try:
        data_schema = unify(
            [h.schema for h in telling], conflicts_to_string=reader.conflicts_to_string
        )
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise SourceError(f"{name}: files disagree on column types ({e})") from e
    if not telling:
        data_schema = pa.schema([(c, pa.string()) for c in columns or ()])
    elif options.schema is None and hasattr(reader, "scan_types"):
        wanted = columns if columns is not None else data_schema.names
        unsettled = _unsettled(data_schema, wanted, data, json_text_columns)
        if unsettled:
            data_schema = _settled(
                data_schema, unsettled, reader, fs, data.paths, heads, fmt, options, limit
            )
    if fmt in ("jsonl", "json") and json_text_columns:
        data_schema = pa.schema(
            [f.with_type(pa.string()) if f.name in json_text_columns else f for f in data_schema]
        )
    hints = [h.hint for h in telling if h.hint]
    full = _full_schema(
        name, data_schema, data, columns, on_bad_line, decoding, hint=hints[0] if hints else None
    )
    read_schema = pa.schema([f for f in data_schema if f.name in full.names])
    counts = [h.num_rows for h in heads]
    source = Source(
        uri=name,
        format=fmt,
        files=[to_url(fs, p) for p in data.paths],
        schema=full,
        num_rows=sum(counts) if all(c is not None for c in counts) else None,
        batch_size=batch_size,
        on_bad_line=on_bad_line,
        is_empty=all(h.is_empty for h in heads),
        _fs=fs,
        _data=data,
        _read_schema=read_schema,
        _options=options,
    )
    if validate == "full":
        source.count_rows()
    return source


def _unsettled(
    schema: pa.Schema, wanted: Sequence[str], data: DataFiles, json_text_columns: Sequence[str]
) -> dict[str, pa.DataType | None]:
    """The columns to read whose type the files' heads cannot settle: those holding
    objects or lists (a later object may have more keys), and those no head showed
    (None), partition columns aside."""
    unsettled: dict[str, pa.DataType | None] = {}
    for name in wanted:
        index = schema.get_field_index(name)
        if index < 0:
            if data.partition_schema.get_field_index(name) < 0:
                unsettled[name] = None
        elif name not in json_text_columns and is_nested(schema.field(index).type):
            unsettled[name] = schema.field(index).type
    return unsettled


def _settled(
    schema: pa.Schema,
    unsettled: dict[str, pa.DataType | None],
    reader,
    fs,
    paths: list[str],
    heads: list[FileHead],
    fmt: str,
    options: ReadOptions,
    limit: int | None,
) -> pa.Schema:
    """`schema` with `unsettled` columns typed over every row read of every file whose
    head did not read it whole; a column found only there is added at the end."""
    types = {name: dtype for name, dtype in unsettled.items() if dtype is not None}
    for path, head in zip(paths, heads):
        if head.is_whole_file:
            continue  # its head's types, in `schema` already, are the file's
        name = display(fs, path)
        try:
            with store_operation("reading", name):
                found = reader.scan_types(fs, path, unsettled, options=options, max_rows=limit)
        except (*PARSE_ERRORS, OSError) as e:
            raise_source_error(name, fmt, e)
        for column, dtype in found.items():
            types[column] = widen(types.get(column), dtype)
    fields = [f.with_type(finish_type(types[f.name])) if f.name in types else f for f in schema]
    added = [c for c in unsettled if c in types and c not in schema.names]
    return pa.schema(fields + [pa.field(c, finish_type(types[c])) for c in added])


def _check_options(
    format, on_bad_line, batch_size, columns, schema, validate, limit=None
) -> str | None:
    # Option mistakes are the caller's, so they are plain ValueErrors raised before any I/O.
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if validate not in ("head", "full"):
        raise ValueError(f"validate must be 'head' or 'full', got {validate!r}")
    if columns is not None:
        if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise ValueError("columns must be a list of column names")
        if len(set(columns)) != len(columns):
            raise ValueError("columns must not repeat a name")
    if schema is not None and not isinstance(schema, pa.Schema):
        raise ValueError("schema must be a pyarrow.Schema")
    if format is None:
        return None
    try:
        fmt = normalize_format(format)
    except ValueError as e:
        raise SourceError(str(e)) from None
    if schema is not None and fmt not in _TEXT_FORMATS:
        raise ValueError(f"schema= is only for {', '.join(_TEXT_FORMATS)} input, not {fmt}")
    return fmt


# Formats whose column types are inferred, so that schema= may give them instead.
_TEXT_FORMATS = ("jsonl", "json", "csv", "tsv")


def _detect(fs, root: str, paths: list[str]) -> str:
    formats: dict[str, str] = {}
    unknown = [p for p in paths if detect_format(p) is None]
    if unknown and len(unknown) == len(paths) and paths != [root]:
        raise SourceError(
            f"{display(fs, root)}: no file in it has a data format's name ({len(paths)} "
            f"file{'s' if len(paths) > 1 else ''}, e.g. "
            f"{display(fs, unknown[0]).rsplit('/', 1)[-1]}): name them "
            f"{known_extensions()} or give the format (--format: {', '.join(FORMATS)})"
        )
    for path in paths:
        fmt = detect_format(path)
        if fmt is None:
            raise SourceError(
                f"{display(fs, path)}: unknown format from the file name; give the format "
                f"(--format: {', '.join(FORMATS)}) or name it {known_extensions()}"
            )
        formats.setdefault(fmt, path)
    if len(formats) > 1:
        found = ", ".join(f"{fmt} ({display(fs, p)})" for fmt, p in formats.items())
        raise SourceError(f"mixed formats in one input: {found}; pass format= or split it")
    return next(iter(formats))


def _read_head(reader, fs, path: str, fmt: str, options: ReadOptions) -> FileHead:
    name = display(fs, path)
    try:
        with store_operation("reading", name):
            return reader.head(fs, path, options=options)
    except FileNotFoundError as e:
        raise SourceError(f"{name}: path does not exist") from e
    except PermissionError as e:
        raise SourceError(access_denied(name)) from e
    except (*PARSE_ERRORS, OSError) as e:
        # At validation time any failure is reported as this file's problem, clearly.
        raise_source_error(name, fmt, e)


def raise_source_error(name: str, fmt: str, error: BaseException):
    """Raise `error`, met reading file `name`, as a SourceError naming the file (and
    never quoting row content)."""
    if isinstance(error, SourceError):
        raise error
    if isinstance(error, (BadLine, FileFormatError)):
        raise SourceError(f"{name}: {error}") from None
    message = safe_arrow_message(str(error))
    text = f"{name}: not a readable {fmt} file ({message or type(error).__name__})"
    if message != str(error):
        # The original message quotes row content; do not let a traceback carry it.
        raise SourceError(text) from None
    raise SourceError(text) from error


def _full_schema(
    name: str,
    data_schema: pa.Schema,
    data: DataFiles,
    columns: Sequence[str] | None,
    on_bad_line: str,
    decoding: Decoding,
    *,
    hint: str | None = None,
) -> pa.Schema:
    # A column stored in the files wins over a same-named partition directory.
    fields = list(data_schema) + [
        f for f in data.partition_schema if data_schema.get_field_index(f.name) < 0
    ]
    fields = [f for f in fields if f.name not in (ERROR_COLUMN, REPLACED_COLUMN)]
    if columns is not None:
        by_name = {f.name: f for f in fields}
        missing = [c for c in columns if c not in by_name]
        if missing:
            raise SourceError(
                f"{name}: column(s) {', '.join(map(repr, missing))} not found; "
                f"available columns: {', '.join(by_name) or '(none)'}"
                + (f" - {hint}" if hint else "")
            )
        fields = [by_name[c] for c in columns]
    if on_bad_line == "skip_row":
        fields.append(pa.field(ERROR_COLUMN, pa.string()))
    if decoding.replaces:
        fields.append(pa.field(REPLACED_COLUMN, pa.bool_()))
    return pa.schema(fields)
