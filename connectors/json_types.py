"""Column types of JSON values: guessed from a file's head, settled over the whole file.

A JSON file states no types, so a reader guesses them from the objects in its first
block (`infer_schema`). A scalar column keeps that guess: a later value that does not fit
it is that row's bad value, named. An object can gain keys anywhere, though, and a
struct type guessed from the head would drop the keys it had not seen without a word.
So the columns a job reads that hold objects or lists (and those the head did not show
at all) have their types settled over every object of the file (`settle_types`):

- a key first seen late joins its struct (rows without it hold null there);
- numbers widen as Arrow's permissive unification does (int64 with double: double);
- values that no one type holds (an object here, a string there; a key that is a number
  in one row and text in another) make the column JSON text - each value's JSON, every
  key kept - as do objects with more than MAX_NESTED_FIELDS distinct keys (a map keyed by
  data, not a record) and objects that are always empty;
- a key or column that is null wherever it appears is text (all its values are null).

`fits_type` is the check for values built into a type one by one (`pa.array` drops a
struct's unknown keys and truncates 1.5 to 1 without a word): what it finds is that
value's error, never a silent loss.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json

# More distinct keys than this in one column's objects (all levels together) is a map
# keyed by data (word counts, per-user scores), not a record: a struct of that many
# children costs more than it serves, so such a column is JSON text.
MAX_NESTED_FIELDS = 1000

_ARROW_REFUSALS = (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError)


def read_objects(
    objects: Sequence[bytes],
    schema: pa.Schema | None,
    *,
    unexpected: str = "ignore",
    newlines_in_values: bool = False,
) -> pa.Table:
    """JSON objects (one per item) parsed by pyarrow in one block.

    Args:
        objects: each one JSON object's bytes.
        schema: the columns' types (None: pyarrow infers them all).
        unexpected: what pyarrow does with a key `schema` lacks, at any depth:
            "ignore" skips it, "infer" adds it with an inferred type.
        newlines_in_values: objects may hold line breaks (pretty-printed array elements).

    Raises:
        pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError: pyarrow refuses one of
        the objects.
    """
    size = sum(len(item) + 1 for item in objects) + 1
    parse = pa_json.ParseOptions(newlines_in_values=newlines_in_values)
    if schema is not None:
        parse = pa_json.ParseOptions(
            explicit_schema=schema,
            unexpected_field_behavior=unexpected,
            newlines_in_values=newlines_in_values,
        )
    return pa_json.read_json(
        io.BytesIO(b"\n".join(objects)),
        # The whole chunk in one block: pyarrow needs each object to fit in one.
        read_options=pa_json.ReadOptions(use_threads=False, block_size=max(1 << 16, size)),
        parse_options=parse,
    )


def infer_schema(rows: Sequence[dict[str, Any]]) -> pa.Schema:
    """Column types from sample rows; a column whose values disagree becomes a string.

    Args:
        rows: parsed sample objects; field order is the order keys first appear.

    Returns:
        A schema; columns whose type the sample cannot tell (all null, only empty
        lists or objects) are strings holding each value's JSON text, as are columns
        of objects with more than MAX_NESTED_FIELDS keys.
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    fields = []
    for name in names:
        dtype = value_type([row.get(name) for row in rows])
        if _is_undetermined(dtype) or num_nested_fields(dtype) > MAX_NESTED_FIELDS:
            dtype = pa.string()
        fields.append(pa.field(name, dtype))
    return pa.schema(fields)


def value_type(values: Sequence[Any]) -> pa.DataType:
    """The type Arrow gives these parsed JSON values; a string when no one type holds them."""
    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
        return pa.string()


def _is_undetermined(dtype: pa.DataType) -> bool:
    # Only nulls, `[]` or `{}` were seen: any later real value would not fit, so the
    # column keeps each value's JSON text instead.
    if pa.types.is_null(dtype):
        return True
    if pa.types.is_struct(dtype):
        return dtype.num_fields == 0 or any(_is_undetermined(f.type) for f in dtype)
    if _is_list(dtype):
        return _is_undetermined(dtype.value_type)
    return False


def is_nested(dtype: pa.DataType) -> bool:
    """Objects or lists: a type whose values can gain keys or elements of new types."""
    return pa.types.is_struct(dtype) or _is_list(dtype)


def num_nested_fields(dtype: pa.DataType) -> int:
    """The struct fields in `dtype`, at every depth."""
    if pa.types.is_struct(dtype):
        return sum(1 + num_nested_fields(f.type) for f in dtype)
    if _is_list(dtype):
        return num_nested_fields(dtype.value_type)
    return 0


def settle_types(
    chunks: Iterable[Sequence[bytes]],
    columns: Mapping[str, pa.DataType | None],
    *,
    newlines_in_values: bool = False,
) -> dict[str, pa.DataType]:
    """The types that hold every value of `columns` in a file's objects.

    Args:
        chunks: the file's objects (each one object's JSON bytes), in batches. Bytes that
            are not a JSON object are passed over: reading the file makes them error rows.
        columns: the columns to settle, each with its type so far (its head's guess; None
            for a column the head did not show).
        newlines_in_values: objects may hold line breaks (array elements).

    Returns:
        A type per column found (a column in no object is left out), as the module
        docstring says; nulls are text only once the whole file was seen (`finish_type`).
    """
    types = {name: dtype for name, dtype in columns.items() if dtype is not None}
    for objects in chunks:
        if objects:
            for name, dtype in _chunk_types(objects, columns, newlines_in_values).items():
                types[name] = widen(types.get(name), dtype)
        if all(types.get(name) == pa.string() for name in columns):
            break  # JSON text holds any value: the rest of the file cannot change it
    return types


def chunks_covering(
    chunks: Iterable[Sequence[Any]], num_rows: int | None
) -> Iterator[Sequence[Any]]:
    """The chunks up to the one holding item `num_rows` (None: all of them), whole: the
    reading that follows cuts a file into the same chunks, so every chunk it parses for
    those rows has been settled."""
    seen = 0
    for chunk in chunks:
        if num_rows is not None and seen >= num_rows:
            return
        seen += len(chunk)
        yield chunk


def _chunk_types(
    objects: Sequence[bytes], columns: Iterable[str], newlines_in_values: bool
) -> dict[str, pa.DataType]:
    """The types of `columns` in one batch of objects (those present in it)."""
    try:
        table = read_objects(objects, None, newlines_in_values=newlines_in_values)
    except _ARROW_REFUSALS:
        table = None
    if table is not None and table.num_rows == len(objects):
        return {
            name: _as_parsed(table.schema.field(name).type)
            for name in columns
            if name in table.column_names
        }
    # A bad object, or values pyarrow will not put in one column: Python's parser, with
    # Arrow's inference per column (a conflict is text, as in the head).
    rows = [row for row in map(_parse_or_none, objects) if row is not None]
    found = {}
    for name in columns:
        values = [row[name] for row in rows if name in row]
        if values:
            found[name] = value_type(values)
    return found


def _parse_or_none(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _as_parsed(dtype: pa.DataType) -> pa.DataType:
    """`dtype` as Python's parser and `pa.array` see it: pyarrow's JSON inference reads
    timestamps out of strings that the rest of the reader keeps as text."""
    if pa.types.is_timestamp(dtype):
        return pa.string()
    if pa.types.is_struct(dtype):
        return pa.struct([f.with_type(_as_parsed(f.type)) for f in dtype])
    if _is_list(dtype):
        return pa.list_(_as_parsed(dtype.value_type))
    return dtype


def widen(known: pa.DataType | None, seen: pa.DataType) -> pa.DataType:
    """One type for the values of two: Arrow's permissive unification, else text."""
    if known is None:
        return seen
    if known == seen:
        return known
    try:
        merged = pa.unify_schemas(
            [pa.schema([("v", known)]), pa.schema([("v", seen)])], promote_options="permissive"
        ).field(0)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string()
    if num_nested_fields(merged.type) > MAX_NESTED_FIELDS:
        return pa.string()
    return merged.type


def finish_type(dtype: pa.DataType) -> pa.DataType:
    """A settled type made ready to read and write: a key (or column, or list item) that
    was only ever null is text, and objects that were only ever empty are JSON text
    (Parquet has no struct without fields)."""
    finished = _without_nulls(dtype)
    return pa.string() if finished is None else finished


def _without_nulls(dtype: pa.DataType) -> pa.DataType | None:
    # None: the value holds an always-empty object, so the whole column is JSON text.
    if pa.types.is_null(dtype):
        return pa.string()
    if pa.types.is_struct(dtype):
        if dtype.num_fields == 0:
            return None
        children = [(f, _without_nulls(f.type)) for f in dtype]
        if any(t is None for _, t in children):
            return None
        return pa.struct([f.with_type(t) for f, t in children])
    if _is_list(dtype):
        item = _without_nulls(dtype.value_type)
        return None if item is None else pa.list_(item)
    return dtype


def fits_type(value: Any, dtype: pa.DataType) -> str | None:
    """Why a parsed JSON value would lose something in `dtype` (None: it would not).

    `pa.array` builds a struct from an object without the keys the struct lacks, and an
    integer from 1.5 by truncating it, without a word; this names the first such key or
    number instead (by its path, never its value).
    """
    return _first_loss(value, dtype, "")


def _first_loss(value: Any, dtype: pa.DataType, path: str) -> str | None:
    if value is None:
        return None
    if pa.types.is_struct(dtype) and isinstance(value, dict):
        names = {f.name: f.type for f in dtype}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in names:
                return f"key {where!r} is not in the column's type"
            problem = _first_loss(item, names[key], where)
            if problem is not None:
                return problem
        return None
    if _is_list(dtype) and isinstance(value, list):
        for index, item in enumerate(value):
            problem = _first_loss(item, dtype.value_type, f"{path}[{index}]")
            if problem is not None:
                return problem
        return None
    if pa.types.is_integer(dtype) and isinstance(value, float) and not value.is_integer():
        return f"a float value{f' at {path!r}' if path else ''} does not fit type {dtype}"
    return None


def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
