"""The input formats: one registry entry each - its name, file extensions and reader.

How to add a format
-------------------
Write a reader (an object with `conflicts_to_string`, `head(fs, path, *, options)` ->
`FileHead` and `iter_batches(fs, path, schema, *, name, options, blanks)` yielding
record batches; `csv_reader.py` and `jsonl_reader.py` are the examples) and append one
`InputFormat` to `_FORMATS`. `open_source`, format detection from file names, the
`format` option's help and `--format` all follow. A reader whose values may hold
objects that its head cannot type for the whole file (JSON) also has
`scan_types(fs, path, columns, *, options, max_rows)`, and says in `FileHead.is_whole_file`
when its head read the whole file (`json_types.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsspec.utils import infer_compression

from tokenmill.connectors.csv_reader import CsvReader
from tokenmill.connectors.json_reader import JsonReader
from tokenmill.connectors.jsonl_reader import JsonlReader
from tokenmill.connectors.openai_batch import OpenAIBatchReader
from tokenmill.connectors.parquet_reader import ParquetReader


@dataclass(frozen=True)
class InputFormat:
    """One input format."""

    name: str
    reader: Callable[[], Any]  # makes the format's reader
    extensions: tuple[str, ...] = ()  # file names that imply it (after any `.gz`)
    aliases: tuple[str, ...] = ()  # other names `format=` accepts
    # Read as a byte stream, so a compression suffix (`.gz`, `.zst`) is looked through.
    # Parquet compresses internally: a gzipped Parquet file is not something we read.
    streams: bool = True
    delimited: bool = False  # delimited text: the csv_delimiter and csv_quote options apply


_FORMATS = (
    InputFormat("parquet", ParquetReader, (".parquet", ".pq"), ("pq",), streams=False),
    InputFormat("jsonl", JsonlReader, (".jsonl", ".ndjson"), ("ndjson",)),
    # A top-level array of objects or JSON Lines, told by the first byte (json_reader.py).
    InputFormat("json", JsonReader, (".json",)),
    InputFormat("csv", CsvReader, (".csv",), delimited=True),
    InputFormat("tsv", lambda: CsvReader("\t"), (".tsv", ".tab"), ("tab",), delimited=True),
    InputFormat("openai-batch", OpenAIBatchReader),
)

FORMATS = tuple(f.name for f in _FORMATS)
DELIMITED_FORMATS = tuple(f.name for f in _FORMATS if f.delimited)

_BY_NAME = {name: f for f in _FORMATS for name in (f.name, *f.aliases)}
_BY_EXTENSION = {ext: f for f in _FORMATS for ext in f.extensions}


def normalize_format(fmt: str) -> str:
    """The canonical name for `fmt`; raises `ValueError` for an unknown one."""
    found = _BY_NAME.get(fmt.lower())
    if found is None:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return found.name


def compression_of(path: str) -> str | None:
    """The fsspec compression codec a file name implies (`gzip` for `.gz`), or None."""
    return infer_compression(path)


def detect_format(path: str) -> str | None:
    """The format a file name implies, looking through a compression suffix; None if unknown."""
    name = path.rsplit("/", 1)[-1].lower()
    codec = compression_of(name)
    if codec is not None:
        name = name.rsplit(".", 1)[0]
    dot = name.rfind(".")
    fmt = _BY_EXTENSION.get(name[dot:]) if dot >= 0 else None
    if fmt is None or (codec is not None and not fmt.streams):
        return None
    return fmt.name


def known_extensions() -> str:
    """The file extensions formats are detected by, for messages."""
    return ", ".join(_BY_EXTENSION)


def get_reader(fmt: str):
    """The reader object for a canonical format name."""
    return _BY_NAME[fmt].reader()
