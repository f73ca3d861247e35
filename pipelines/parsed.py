"""`tokenmill.generate(..., parse=True)`: the fields of JSON outputs as a polars struct.

Only complete outputs are parsed (`structured_output_complete` true): a cut-off JSON
document is never read as data. The struct's type comes from the JSON schema where the
schema pins one down (objects with properties, arrays with items, scalar types, enums
of one kind, nullable variants); otherwise polars infers it from the outputs.
"""

from __future__ import annotations

from typing import Any

PARSED_COLUMN = "parsed"
_MAX_DEPTH = 32  # $ref chains and nesting deeper than this are left to inference


def with_parsed(df: Any, schema: dict | None) -> Any:
    """`df` with a `parsed` column: each complete output's JSON, decoded.

    Args:
        df: generate's results (polars), with `output` and `structured_output_complete`.
        schema: the JSON schema every output follows, or None (json_object, per-row
            schemas): the type is then inferred from the outputs.

    Returns:
        The DataFrame with `parsed` after `structured_output_complete`.
    """
    import polars as pl

    if "structured_output_complete" not in df.columns:  # no row was constrained
        df = df.with_columns(pl.lit(None, pl.Boolean).alias("structured_output_complete"))
    complete = pl.col("structured_output_complete").fill_null(False)
    text = pl.when(complete).then(pl.col("output"))
    dtype = json_schema_dtype(schema) if schema is not None else None
    decoded = text.str.json_decode(dtype) if dtype is not None else text.str.json_decode()
    parsed = df.with_columns(decoded.alias(PARSED_COLUMN))
    order = list(df.columns)
    order.insert(order.index("structured_output_complete") + 1, PARSED_COLUMN)
    return parsed.select(order)


def json_schema_dtype(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """The polars type a JSON schema's values decode to, or None if it has none.

    Args:
        schema: a (sub)schema.
        root: the whole schema, for local `$ref`s (default: `schema`).
        depth: nesting so far.
    """
    import polars as pl

    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "$ref" in schema:
        return json_schema_dtype(_resolve(schema["$ref"], root), root, depth + 1)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return _common([_value_dtype(v) for v in values if v is not None])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [json_schema_dtype(s, root, depth + 1) for s in schema[key]]
            return _common([o for o in options if o != pl.Null])
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return _common([json_schema_dtype({**schema, "type": k}, root, depth) for k in kinds])
    if kind == "object" and isinstance(schema.get("properties"), dict):
        fields = {
            name: json_schema_dtype(sub, root, depth + 1)
            for name, sub in schema["properties"].items()
        }
        if any(dtype is None for dtype in fields.values()):
            return None
        return pl.Struct(fields)
    if kind == "array":
        items = json_schema_dtype(schema.get("items"), root, depth + 1)
        return pl.List(items) if items is not None else None
    scalars = {
        "string": pl.String,
        "integer": pl.Int64,
        "number": pl.Float64,
        "boolean": pl.Boolean,
        "null": pl.Null,
    }
    return scalars.get(kind)


def _resolve(ref: Any, root: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref.lstrip("#").strip("/").split("/"):
        if not part:
            continue
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _value_dtype(value: Any) -> Any:
    import polars as pl

    if isinstance(value, bool):
        return pl.Boolean
    if isinstance(value, int):
        return pl.Int64
    if isinstance(value, float):
        return pl.Float64
    if isinstance(value, str):
        return pl.String
    return None


def _common(dtypes: list[Any]) -> Any:
    """The one type all of `dtypes` are (integers widen to floats), else None."""
    import polars as pl

    if not dtypes or any(d is None for d in dtypes):
        return None
    if all(d == dtypes[0] for d in dtypes):
        return dtypes[0]
    if all(d in (pl.Int64, pl.Float64) for d in dtypes):
        return pl.Float64
    return None
