"""The results schema, and building a shard's results table from engine outputs.

Pure functions. One result row per input row:

    id, output, finish_reason (stop | length | error), prompt_tokens, cached_tokens,
    completion_tokens, error (null when ok), then the passthrough columns asked for.

Error rows (bad input, over-long prompts, requests the engine could not serve) carry
zero tokens: nothing was billed for them, and the ledger sums the rows as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from tokenmill.engine.outputs import RequestOutput
from tokenmill.pipelines.tokenize import PromptRow

RESULT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("output", pa.string()),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("prompt_tokens", pa.int64(), nullable=False),
        pa.field("cached_tokens", pa.int64(), nullable=False),
        pa.field("completion_tokens", pa.int64(), nullable=False),
        pa.field("error", pa.string()),
    ]
)
RESULT_COLUMNS = tuple(RESULT_SCHEMA.names)
FINISH_REASONS = frozenset({"stop", "length", "error"})


def check_passthrough(names: Sequence[str]) -> None:
    """Raise ValueError if passthrough columns clash with result columns or repeat."""
    clash = [n for n in names if n in RESULT_COLUMNS]
    if clash:
        raise ValueError(
            f"passthrough column(s) {', '.join(map(repr, clash))} clash with result columns "
            f"({', '.join(RESULT_COLUMNS)})"
        )
    if len(set(names)) != len(names):
        raise ValueError("passthrough columns repeat")


def result_record(row: PromptRow, output: RequestOutput | None) -> dict:
    """One result row as a dict, from a prompt row and (if it ran) its engine output."""
    if row.error is not None:
        return _error_record(row.id, row.error)
    if output is None:
        return _error_record(row.id, "no output from the engine")
    reason = output.finish_reason if output.outputs else "error"
    if output.error is not None or reason not in FINISH_REASONS or reason == "error":
        return _error_record(row.id, output.error or f"engine finished with {reason!r}")
    return {
        "id": row.id,
        "output": output.text,
        "finish_reason": reason,
        "prompt_tokens": int(output.prompt_tokens),
        "cached_tokens": int(output.cached_tokens),
        "completion_tokens": int(output.completion_tokens),
        "error": None,
    }


def _error_record(row_id: str, message: str) -> dict:
    return {
        "id": row_id,
        "output": None,
        "finish_reason": "error",
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "error": message,
    }


def build_results(
    rows: Sequence[PromptRow],
    outputs: Mapping[int, RequestOutput],
    *,
    passthrough: pa.Table | None = None,
) -> pa.Table:
    """A results table for `rows`, in their order.

    Args:
        rows: the prompt rows (good and bad), in the order the table should have.
        outputs: engine output by row index, for the rows that ran.
        passthrough: columns to carry over, one row per entry of `rows`, same order.

    Returns:
        A table with RESULT_SCHEMA's columns followed by the passthrough columns.
    """
    records = [result_record(r, outputs.get(r.row_index)) for r in rows]
    table = pa.Table.from_pylist(records, schema=RESULT_SCHEMA)
    if passthrough is not None and passthrough.num_columns:
        if passthrough.num_rows != table.num_rows:
            raise ValueError(
                f"passthrough has {passthrough.num_rows} rows for {table.num_rows} results"
            )
        check_passthrough(passthrough.column_names)
        for name in passthrough.column_names:
            table = table.append_column(passthrough.schema.field(name), passthrough[name])
    return table


def latencies(outputs: Mapping[int, RequestOutput]) -> list[float]:
    """Per-request latencies (seconds) of the requests that were served."""
    values = []
    for out in outputs.values():
        latency = out.metrics.latency if out.metrics is not None else None
        if out.error is None and latency is not None:
            values.append(float(latency))
    return values
