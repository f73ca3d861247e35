"""Result parts, JSON documents and append-only datasets, each file written atomically."""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.connectors.atomic import atomic_file, atomic_write, is_temp_name
from tokenmill.connectors.fs import display, is_hidden, redact_url, resolve, to_url
from tokenmill.connectors.jsonutil import dumps_line, to_jsonable
from tokenmill.connectors.source import open_source
from tokenmill.connectors.store_retries import store_operation

PART_FORMATS = {"parquet": ".parquet", "jsonl": ".jsonl"}


def write_part(
    table: pa.Table | pa.RecordBatch,
    uri_dir: str,
    part_name: str,
    *,
    format: str = "parquet",
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Writes one part file atomically: it is listed complete or not at all.

    Args:
        table: the rows.
        uri_dir: the directory URL holding the parts.
        part_name: a stable name such as `part-00003`; the extension is added if missing.
        format: "parquet" (zstd) or "jsonl".
        storage_options: filesystem options (credentials, endpoint); never shown.
        overwrite: replace an existing part; by default an existing one raises
            `FileExistsError`, so a shard can never be written twice by mistake.

    Returns:
        The part's URL.
    """
    ext = _part_ext(format)
    if not part_name or "/" in part_name or part_name.startswith(("_", ".")):
        raise ValueError(f"part_name must be a plain file name, got {part_name!r}")
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    name = part_name if part_name.endswith(ext) else part_name + ext
    fs, directory = resolve(uri_dir, storage_options)
    path = posixpath.join(directory.rstrip("/"), name)
    atomic_write(fs, path, lambda f: _serialize(table, format, f), overwrite=overwrite)
    return to_url(fs, path)


def _serialize(table: pa.Table, format: str, f: BinaryIO) -> None:
    if format == "parquet":
        pq.write_table(table, f, compression="zstd")
        return
    for batch in table.to_batches():
        lines = "".join(dumps_line(row) + "\n" for row in batch.to_pylist())
        f.write(lines.encode("utf-8"))


def list_parts(
    uri_dir: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    format: str | None = None,
) -> list[str]:
    """URLs of the complete parts in a directory, sorted; temp files never appear.

    Args:
        uri_dir: the directory URL; a missing directory has no parts.
        storage_options: filesystem options.
        format: only parts of this format (default: Parquet and JSONL parts).

    Returns:
        Sorted part URLs.
    """
    extensions = (_part_ext(format),) if format else tuple(PART_FORMATS.values())
    fs, directory = resolve(uri_dir, storage_options)
    # Another process may have published parts since this filesystem cached a listing.
    fs.invalidate_cache(directory)
    with store_operation("listing", display(fs, directory)):
        if not fs.exists(directory):
            return []
        entries = fs.ls(directory, detail=True)
    paths = [
        e["name"]
        for e in entries
        if e.get("type") == "file"
        and _is_part_name(posixpath.basename(e["name"].rstrip("/")), extensions)
    ]
    return [to_url(fs, p) for p in sorted(paths)]


def _is_part_name(name: str, extensions: Sequence[str]) -> bool:
    return not is_hidden(name) and not is_temp_name(name) and name.endswith(tuple(extensions))


def read_parts(
    uri_dir: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """All complete parts of a directory as one table.

    Parts written at different times may differ: missing columns become null and
    types promote (int to float, null to anything), as an append-only ledger needs.

    Args:
        uri_dir: the directory URL.
        storage_options: filesystem options.
        columns: keep only these columns.

    Returns:
        The concatenated table (no columns at all when there are no parts).
    """
    tables = [read_part(url, storage_options) for url in list_parts(uri_dir, storage_options)]
    if not tables:
        return pa.table({})
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise ValueError(f"{redact_url(uri_dir)}: parts disagree on column types ({e})") from e
    if columns is not None:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(
                f"{redact_url(uri_dir)}: column(s) {missing} not found; "
                f"available columns: {', '.join(table.column_names)}"
            )
        table = table.select(list(columns))
    return table


def read_part(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """One part file (Parquet or JSON Lines, by its extension) as a table.

    Args:
        url: the part's URL, e.g. from `list_parts`.
        storage_options: filesystem options.
        columns: read only these columns (Parquet reads skip the others' bytes).
    """
    if url.endswith(PART_FORMATS["parquet"]):
        fs, path = resolve(url, storage_options)
        # No Arrow thread: reading a Python file object on Arrow's pools (decoding on the
        # CPU pool, pre-buffering on the IO pool), a process could abort at exit after its
        # work was done ("terminate called without an active exception", SIGABRT;
        # apache/arrow#34314, #50482). Fresh processes reading one file, 2 cores busy: 9
        # of 60 aborted; 2 of 60 without the CPU pool; 0 of 60 without either - and yet
        # 1 of 8 in a CI run, because pq.read_table goes through the dataset reader, which
        # starts an IO-pool thread even then. ParquetFile.read starts none. A part is one
        # shard's rows.
        with store_operation("reading", display(fs, path)), fs.open(path, "rb") as f:
            columns = list(columns) if columns is not None else None
            return pq.ParquetFile(f, pre_buffer=False).read(columns=columns, use_threads=False)
    table = open_source(url, storage_options=storage_options).to_table()
    return table.select(list(columns)) if columns is not None else table


def append_to_dataset(
    uri_dir: str,
    table: pa.Table | pa.RecordBatch,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Adds one new Parquet file to an append-only dataset; existing files are never touched.

    File names sort by write time, so `read_parts` returns rows in append order.

    Returns:
        The new file's URL.
    """
    name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    return write_part(table, uri_dir, name, storage_options=storage_options)


def write_json_atomic(
    uri: str,
    obj: Any,
    storage_options: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = True,
) -> str:
    """Writes a JSON document (e.g. `ledger.json`) atomically.

    Dataclasses, datetimes and numpy scalars are converted; NaN becomes null.

    Returns:
        The document's URL.
    """
    data = (json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n").encode()
    fs, path = resolve(uri, storage_options)
    atomic_write(fs, path, lambda f: f.write(data), overwrite=overwrite)
    return to_url(fs, path)


def read_json(uri: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Reads a JSON document written by `write_json_atomic`."""
    fs, path = resolve(uri, storage_options)
    with store_operation("reading", display(fs, path)), fs.open(path, "rb") as f:
        return json.load(f)


@contextlib.contextmanager
def lines_writer(
    uri: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Iterator[Callable[[str], None]]:
    """`write(line)` for a text file of lines (each gets a newline), written atomically:
    the file appears complete when the `with` block ends, not at all if it raises.

    Used for OpenAI batch output files, written window by window.
    """
    fs, path = resolve(uri, storage_options)
    with atomic_file(fs, path, overwrite=overwrite) as f:
        yield lambda line: f.write(line.encode("utf-8") + b"\n")


def _part_ext(format: str) -> str:
    if format not in PART_FORMATS:
        raise ValueError(f"format must be one of {', '.join(PART_FORMATS)}, got {format!r}")
    return PART_FORMATS[format]
