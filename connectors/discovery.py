"""Which files a URL means: one file, a directory tree, or a glob; plus hive partitions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from tokenmill.connectors.errors import SourceError, access_denied
from tokenmill.connectors.fs import display, is_hidden, protocol_of, relative_to

_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INT = re.compile(r"-?\d{1,18}")


@dataclass(frozen=True)
class DataFiles:
    """The data files behind one URL, in read order, with their partition values."""

    paths: list[str]
    # Per file: partition column -> value, from `key=value` directories under the root.
    partitions: list[dict[str, Any]] = field(default_factory=list)
    partition_schema: pa.Schema = field(default_factory=lambda: pa.schema([]))


def discover(fs, path: str) -> DataFiles:
    """Lists the data files `path` stands for, skipping `_`- and `.`-prefixed names.

    Args:
        fs: the fsspec filesystem.
        path: a file, a directory (searched recursively), or a glob pattern.

    Returns:
        `DataFiles` sorted by path; raises `SourceError` when there are none.
    """
    try:
        return _discover(fs, path)
    except PermissionError as e:
        raise SourceError(access_denied(display(fs, path))) from e


def _discover(fs, path: str) -> DataFiles:
    name = display(fs, path)
    if has_magic(path):
        root = _glob_root(path)
        found = fs.glob(path, detail=True)
        paths = _visible_files(found, root)
        if not paths:
            raise SourceError(f"{name}: no data files match this pattern")
        return _with_partitions(paths, root)
    if not fs.exists(path):
        raise SourceError(f"{name}: path does not exist")
    # HTTP has no directories to list; a URL there is always one file.
    if protocol_of(fs) in ("http", "https") or not fs.isdir(path):
        return DataFiles(paths=[path], partitions=[{}])
    paths = _visible_files(fs.find(path, detail=True), path)
    if not paths:
        fs.ls(path, detail=False)  # a directory it may not list (fsspec's find says nothing)
        raise SourceError(
            f"{name}: no data files in this directory (names starting with _ or . are "
            "skipped): point the input at the directory or file that holds the data"
        )
    return _with_partitions(paths, path)


def has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    plain = []
    for part in parts:
        if has_magic(part):
            break
        plain.append(part)
    return "/".join(plain)


def _visible_files(found: dict[str, dict], root: str) -> list[str]:
    return sorted(
        p
        for p, info in found.items()
        if info.get("type") == "file" and not is_hidden(relative_to(root, p))
    )


def _with_partitions(paths: list[str], root: str) -> DataFiles:
    raw: list[dict[str, str | None]] = []
    keys: dict[str, None] = {}
    for path in paths:
        values: dict[str, str | None] = {}
        for part in relative_to(root, path).split("/")[:-1]:
            key, eq, value = part.partition("=")
            if eq and key:
                values[key] = None if value == _HIVE_NULL else unquote(value)
                keys[key] = None
        raw.append(values)
    fields = []
    for key in keys:
        present = [v[key] for v in raw if v.get(key) is not None]
        is_int = bool(present) and all(_INT.fullmatch(v) for v in present)
        fields.append(pa.field(key, pa.int64() if is_int else pa.string()))
    schema = pa.schema(fields)
    partitions = [{f.name: _typed(values.get(f.name), f.type) for f in schema} for values in raw]
    return DataFiles(paths=paths, partitions=partitions, partition_schema=schema)


def _typed(value: str | None, dtype: pa.DataType) -> Any:
    if value is None:
        return None
    return int(value) if pa.types.is_integer(dtype) else value
