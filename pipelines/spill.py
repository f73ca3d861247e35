"""A shard's planned rows as one Arrow table: what planning writes and `run_shard` reads.

Pure functions. Planning keeps one window in memory at a time; each shard it cuts is
written out as `OUTPUT/_plan/<shard_id>.parquet` (see `output.write_plan_shard`), so
the plan itself holds only shard names and sizes, and a shard's task - on any worker -
reads just its own rows. The table, one row per planned row, in run order:

    row_index     int64          global input position (0..n-1)
    id            string         the row's id
    token_ids     list<int32>    prompt tokens; null for an error row
    error         string         why the row failed before compute; null otherwise
    params_index  int32          index into the job's distinct SamplingParams
    truncated     bool           the text was cut to the model's max_seq_length (pooling)
    lora_index    int32          the row's LoRA adapter (0: the base model); only in the
                                 plans of jobs with adapters
    url           string         OpenAI batch input only: the request's endpoint
    tool_calls    string         OpenAI batch input only: how the answer is read as tool
                                 calls (JSON; null: it is not)
    max_tokens_requested  int64  OpenAI batch input only: the budget a row asked for when
                                 it was capped to the context left (null: not capped)
    images        list<binary>   jobs with an image column, compute shards only: each row's
                                 images, encoded (a resumed shard reads them here, so it
                                 never reads the source's paths or URLs again)
    source_row_index  int64      copy shards only (pipelines/dedupe.py): the row whose
    source_shard      string     answer each copy takes, and the shard that computes it
    passthrough/<name>           each passthrough column, as read

Passthrough columns carry a prefix so that no input column name can clash with ours.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tokenmill.pipelines.tokenize import PromptRow

PASSTHROUGH_PREFIX = "passthrough/"
URL_COLUMN = "url"
TOOL_CALLS_COLUMN = "tool_calls"
REQUESTED_COLUMN = "max_tokens_requested"
LORA_COLUMN = "lora_index"
IMAGES_COLUMN = "images"
SOURCE_ROW_COLUMN = "source_row_index"
SOURCE_SHARD_COLUMN = "source_shard"


@dataclass
class ShardRows:
    """A shard's rows read back, ready to run."""

    rows: list[PromptRow]  # in run order
    passthrough: pa.Table | None  # one row per entry of `rows`, same order
    endpoints: list[str | None] | None  # OpenAI batch: each row's request url
    # A copy shard's rows: (source row index, source shard id) per row; None otherwise.
    sources: list[tuple[int, str]] | None = None


def shard_table(
    rows: Sequence[PromptRow],
    *,
    passthrough: pa.Table | None = None,
    endpoints: Sequence[str | None] | None = None,
    tool_calls: Sequence[str | None] | None = None,
    sources: Sequence[tuple[int, str]] | None = None,
) -> pa.Table:
    """The table for a shard's rows (in run order).

    Args:
        rows: the shard's rows.
        passthrough: passthrough columns, one row per entry of `rows`, same order.
        endpoints: each row's request url (OpenAI batch input), same order.
        tool_calls: each row's tool call reading (OpenAI batch input), same order.
        sources: a copy shard's (source row index, source shard id) per row.

    Returns:
        The table described in the module docstring.
    """
    lengths = np.fromiter((r.num_prompt_tokens for r in rows), np.int32, len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    tokens = b"".join(_token_bytes(r) for r in rows if r.token_ids is not None)
    token_ids = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(np.frombuffer(tokens, np.int32), pa.int32()),
        mask=pa.array([r.token_ids is None for r in rows], pa.bool_()),
    )
    columns = {
        "row_index": pa.array([r.row_index for r in rows], pa.int64()),
        "id": pa.array([r.id for r in rows], pa.string()),
        "token_ids": token_ids,
        "error": pa.array([r.error for r in rows], pa.string()),
        "params_index": pa.array([r.params_index for r in rows], pa.int32()),
        "truncated": pa.array([r.truncated for r in rows], pa.bool_()),
    }
    if any(r.lora_index for r in rows):
        columns[LORA_COLUMN] = pa.array([r.lora_index for r in rows], pa.int32())
    if endpoints is not None:
        columns[URL_COLUMN] = pa.array(list(endpoints), pa.string())
    if tool_calls is not None:
        columns[TOOL_CALLS_COLUMN] = pa.array(list(tool_calls), pa.string())
    if endpoints is not None:
        columns[REQUESTED_COLUMN] = pa.array([r.max_tokens_requested for r in rows], pa.int64())
    # A copy shard computes nothing: its rows' images stay with their sources.
    if sources is None and any(r.images for r in rows):
        columns[IMAGES_COLUMN] = pa.array([list(r.images) for r in rows], pa.list_(pa.binary()))
    if sources is not None:
        columns[SOURCE_ROW_COLUMN] = pa.array([s[0] for s in sources], pa.int64())
        columns[SOURCE_SHARD_COLUMN] = pa.array([s[1] for s in sources], pa.string())
    table = pa.table(columns)
    if passthrough is not None:
        for name in passthrough.column_names:
            field = passthrough.schema.field(name).with_name(PASSTHROUGH_PREFIX + name)
            table = table.append_column(field, passthrough[name])
    return table


def _token_bytes(row: PromptRow) -> bytes:
    ids = row.token_ids
    return (ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)).tobytes()


def shard_rows(table: pa.Table) -> ShardRows:
    """A shard table back as prompt rows (the inverse of `shard_table`)."""
    columns = {
        name: table[name].to_pylist()
        for name in ("row_index", "id", "error", "params_index", "token_ids")
    }
    num_rows = table.num_rows
    truncated = (
        table["truncated"].to_pylist() if "truncated" in table.column_names else [False] * num_rows
    )
    loras = table[LORA_COLUMN].to_pylist() if LORA_COLUMN in table.column_names else [0] * num_rows
    images = (
        table[IMAGES_COLUMN].to_pylist()
        if IMAGES_COLUMN in table.column_names
        else [None] * num_rows
    )
    rows = [
        PromptRow(
            row_index,
            rid,
            token_ids=None if tokens is None else array("i", tokens),
            error=error,
            params_index=params_index,
            truncated=bool(cut),
            lora_index=lora_index,
            images=tuple(row_images or ()),
        )
        for (row_index, rid, error, params_index, tokens), cut, lora_index, row_images in zip(
            zip(*columns.values()), truncated, loras, images
        )
    ]
    names = [n for n in table.column_names if n.startswith(PASSTHROUGH_PREFIX)]
    passthrough = None
    if names:
        passthrough = table.select(names).rename_columns(
            [n[len(PASSTHROUGH_PREFIX) :] for n in names]
        )
    endpoints = table[URL_COLUMN].to_pylist() if URL_COLUMN in table.column_names else None
    sources = None
    if SOURCE_ROW_COLUMN in table.column_names:
        sources = list(
            zip(table[SOURCE_ROW_COLUMN].to_pylist(), table[SOURCE_SHARD_COLUMN].to_pylist())
        )
    return ShardRows(rows, passthrough, endpoints, sources)
