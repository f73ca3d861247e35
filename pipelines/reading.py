"""Input batches -> tokenized prompt rows, with the job-level checks on ids.

Streams the source batch by batch: each batch is templated and batch-encoded as it
arrives. Per-row problems (bad prompt, unparseable line, invalid per-row sampling
params, over-long prompt) become error rows; problems with the job as a whole (null or
duplicate ids) raise ValueError after the whole input has been seen, so the message
can count them - still before any compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from tokenmill.connectors import ERROR_COLUMN
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines.spec import PER_ROW_FIELDS, JobSpec, ParamsTable
from tokenmill.pipelines.templating import RenderedRow, render_rows, row_ids
from tokenmill.pipelines.tokenize import PromptRow, chat_renderer, tokenize_rows

_MAX_LISTED = 5  # ids quoted in a duplicate-id error


@dataclass
class ReadRows:
    """Everything the planner needs from the input."""

    rows: list[PromptRow] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    passthrough: pa.Table | None = None
    endpoints: list[str | None] | None = None


def read_rows(source: Any, spec: JobSpec, tokenizer: Any, *, max_model_len: int) -> ReadRows:
    """Read, template and tokenize every input row (up to `spec.limit`).

    Args:
        source: an opened connectors Source (`iter_batches()`, `uri`).
        spec: the job.
        tokenizer: the model's tokenizer (`encode_batch`, `apply_chat_template`).
        max_model_len: the model's context length.

    Returns:
        ReadRows with one PromptRow per input row, row_index 0..n-1.

    Raises:
        ValueError: the id column has nulls or duplicates.
    """
    template = spec.template_spec
    chat = chat_renderer(tokenizer)
    table = ParamsTable(spec.sampling)
    result = ReadRows()
    passthrough: list[pa.RecordBatch] = []
    endpoints: list[str | None] = []
    start = 0
    for batch in source.iter_batches():
        if spec.limit is not None:
            batch = batch.slice(0, spec.limit - start)
        if batch.num_rows == 0:
            break
        columns = batch.to_pydict()
        rendered = render_rows(columns, template, start=start, chat=chat)
        rendered = _mark_bad_lines(rendered, columns.get(ERROR_COLUMN), start)
        params_index = _params_index(columns, spec, table, rendered)
        rendered = [r for r, _ in params_index]
        indices = [i for _, i in params_index]
        budgets = [table.params[i].max_tokens for i in indices]
        result.rows += tokenize_rows(
            tokenizer,
            rendered,
            max_model_len=max_model_len,
            max_tokens=budgets,
            params_index=indices,
        )
        if spec.passthrough:
            passthrough.append(batch.select(list(spec.passthrough)))
        if spec.is_openai_batch:
            endpoints += columns["url"]
        start += batch.num_rows
        if spec.limit is not None and start >= spec.limit:
            break
    check_ids(result.rows, id_column=spec.id_column, source=source.uri)
    result.params = table.params
    if passthrough:
        result.passthrough = pa.Table.from_batches(passthrough)
    result.endpoints = endpoints if spec.is_openai_batch else None
    return result


def _mark_bad_lines(
    rendered: list[RenderedRow], errors: list | None, start: int
) -> list[RenderedRow]:
    """Rows the connector could not parse become error rows (with a position id if needed)."""
    if errors is None:
        return rendered
    fixed = []
    for i, (row, error) in enumerate(zip(rendered, errors)):
        if error is None:
            fixed.append(row)
            continue
        rid = row.id if row.id is not None else row_ids(None, start + i, 1)[0]
        fixed.append(RenderedRow(row.row_index, rid, error=error))
    return fixed


def _params_index(
    columns: dict[str, list], spec: JobSpec, table: ParamsTable, rendered: list[RenderedRow]
) -> list[tuple[RenderedRow, int]]:
    """Each row's sampling params index; invalid per-row params make the row an error."""
    if not spec.is_openai_batch:
        return [(r, 0) for r in rendered]
    present = [k for k in PER_ROW_FIELDS if k in columns]
    pairs = []
    for i, row in enumerate(rendered):
        try:
            index = table.for_row({k: columns[k][i] for k in present})
        except ValueError as exc:
            if row.error is None:
                row = replace(row, text=None, error=str(exc))
            index = 0
        pairs.append((row, index))
    return pairs


def check_ids(rows: list[PromptRow], *, id_column: str | None, source: str) -> None:
    """Raise ValueError if any id is null or repeats (ids key resume and the results)."""
    nulls = [r.row_index for r in rows if r.id is None]
    if nulls:
        raise ValueError(
            f"{source}: id column {id_column!r} is null in {len(nulls)} row(s) "
            f"(first at row {nulls[0]}); every row needs an id"
        )
    seen: set[str] = set()
    duplicates: dict[str, None] = {}
    for r in rows:
        if r.id in seen:
            duplicates[r.id] = None
        seen.add(r.id)
    if duplicates:
        listed = ", ".join(repr(d) for d in list(duplicates)[:_MAX_LISTED])
        more = f" and {len(duplicates) - _MAX_LISTED} more" if len(duplicates) > _MAX_LISTED else ""
        raise ValueError(
            f"{source}: {len(duplicates)} duplicate id(s) in column {id_column!r}: {listed}{more}; "
            "ids must be unique (each id gets exactly one result row)"
        )
