"""Format names, detection from file names, and the reader for each format."""

from __future__ import annotations

from fsspec.utils import infer_compression

from tokenmill.connectors.csv_reader import CsvReader
from tokenmill.connectors.jsonl_reader import JsonlReader
from tokenmill.connectors.openai_batch import OpenAIBatchReader
from tokenmill.connectors.parquet_reader import ParquetReader

FORMATS = ("parquet", "jsonl", "csv", "openai-batch")

_ALIASES = {"pq": "parquet", "ndjson": "jsonl", "json": "jsonl"}

_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
}

# Parquet compresses internally; a gzipped Parquet file is not something we read.
_STREAM_FORMATS = frozenset({"jsonl", "csv", "openai-batch"})


def normalize_format(fmt: str) -> str:
    """The canonical name for `fmt`; raises `ValueError` for an unknown one."""
    name = _ALIASES.get(fmt.lower(), fmt.lower())
    if name not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return name


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
    fmt = _EXTENSIONS.get(name[dot:]) if dot >= 0 else None
    if fmt is not None and codec is not None and fmt not in _STREAM_FORMATS:
        return None
    return fmt


def get_reader(fmt: str):
    """The reader object for a canonical format name."""
    return _READERS[fmt]()


_READERS = {
    "parquet": ParquetReader,
    "jsonl": JsonlReader,
    "csv": CsvReader,
    "openai-batch": OpenAIBatchReader,
}
