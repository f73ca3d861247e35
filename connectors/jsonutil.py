"""Turning Python and Arrow values into strict JSON (no NaN, no custom objects)."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import json
import math
from collections.abc import Mapping
from typing import Any


def to_jsonable(value: Any) -> Any:
    """A copy of `value` that `json.dumps` accepts and every JSON parser can read.

    Dataclasses become objects, datetimes ISO 8601 strings, bytes base64, decimals
    strings (keeping their precision); NaN and infinities become null since JSON has
    no spelling for them. Anything else unknown raises `TypeError`.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if hasattr(value, "item") and callable(value.item):
        # numpy scalars
        return to_jsonable(value.item())
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def dumps_line(value: Any) -> str:
    """Compact one-line JSON (non-ASCII text kept as is)."""
    return json.dumps(to_jsonable(value), ensure_ascii=False, separators=(",", ":"))
