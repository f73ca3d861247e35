"""The results schema, and building a shard's results table from engine outputs.

Pure functions. One result row per input row:

    id, output, finish_reason (stop | length | error), prompt_tokens, cached_tokens,
    completion_tokens, error (null when ok), then the passthrough columns asked for.

A scoring job's rows (`pipelines/scoring.py`) have the same columns - output null,
finish_reason score | error, completion_tokens 0 - plus `prompt_logprob_sum` and
`perplexity` after `error`; a pooling job's (`pipelines/pooling.py`: embed, classify,
rerank) its task's columns there, as its `PoolingLayout` says. The schema is fixed by
the task, so every part of a job has the same one, and a job's rows are all of one task.

Error rows (bad input, over-long prompts, requests the engine could not serve) carry
zero tokens: nothing was billed for them, and the ledger sums the rows as they are.

Two columns join when a job asks for them (decided once per job, so every part of a job
has the same schema):

    structured_output_complete  bool: false when a constrained output was cut short
                                (max_tokens, a stop string) - do not parse it; null on
                                unconstrained and error rows. With any structured outputs.
    completions                 list of {index, output, finish_reason,
                                structured_output_complete}: every one of a row's n
                                completions (`output` is the first). With any n > 1.
    logprobs                    list of {token, logprob, bytes, top_logprobs}: each
                                generated token of `output` (`pipelines/logprobs.py`);
                                each completion has its own in `completions`. With any
                                logprobs asked for; null on rows that did not ask.
    duplicate_of                string: the id of the identical row whose answer this
                                row takes (null on rows computed themselves); such a row
                                bills no tokens (`pipelines/dedupe.py`). With any row
                                deduplicated.

    embedding, truncated        an OpenAI batch file's /v1/embeddings lines: each
                                line's embedding (list of float32; null on other rows)
                                and whether its text was cut. With any such line.
    adapter                     string: the LoRA adapter the row ran with (or asked for,
                                on an error row); null for the base model. With any
                                LoRA adapters (`pipelines/adapters.py`).
    image_tokens                int64: of the row's prompt_tokens, its images' soft
                                tokens (0 on error rows and copies, which bill none).
                                With an image column, or OpenAI batch lines with images.
    reasoning_content           string: the reasoning a chat answer wrote apart (gpt-oss's
                                analysis channel, Qwen3's <think> block), split from
                                `output`, which keeps the final answer; null when the row
                                wrote none. With a chat job on a model whose template
                                writes reasoning apart (`JobPlan.reasoning_format`).
    reasoning_tokens            int64: of completion_tokens, those the split put in
                                reasoning (`engine/api/reasoning.py` counts them from
                                the token ids); 0 where it wrote none, on error rows
                                and on copies, which bill none. With reasoning_content.

and one when the job reads its input with `on_decode_error="replace"`:

    decode_replaced             bool: true when bytes of the row's input were not valid
                                in the input's encoding and were replaced by U+FFFD
                                (the row was answered from the replaced text). It is
                                read with the input, so it travels with the passthrough
                                columns (`DECODE_REPLACED`) and comes before them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from tokenmill.engine import (
    CompletionOutput,
    PoolingOutput,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)
from tokenmill.pipelines.logprobs import LOGPROBS_TYPE, LogprobsColumn
from tokenmill.pipelines.pooling import POOLING_JOB_TASKS, PoolingLayout, pooling_columns
from tokenmill.pipelines.scoring import GENERATE, SCORE, SCORE_FINISH_REASON, prompt_score
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
SCORE_RESULT_SCHEMA = RESULT_SCHEMA.append(pa.field("prompt_logprob_sum", pa.float64())).append(
    pa.field("perplexity", pa.float64())
)
RESULT_COLUMNS = tuple(RESULT_SCHEMA.names)
FINISH_REASONS = frozenset({"stop", "length", "error"})
COMPLETION_TYPE = pa.struct(
    [
        ("index", pa.int64()),
        ("output", pa.string()),
        ("finish_reason", pa.string()),
        ("structured_output_complete", pa.bool_()),
    ]
)
DUPLICATE_OF = "duplicate_of"
DECODE_REPLACED = "decode_replaced"
# The OpenAI batch output's error code of a row a stopped job never ran
# (`running.stop_shard`); only in such a shard's part, and in its copies'.
ERROR_CODE = "error_code"
ADAPTER = "adapter"
IMAGE_TOKENS = "image_tokens"
REASONING_CONTENT = "reasoning_content"
REASONING_TOKENS = "reasoning_tokens"
# An OpenAI batch file's embeddings in a generation job's results (sizes may differ).
_LINE_EMBEDDINGS = PoolingLayout("embed")
EXTRA_FIELDS = {
    "structured_output_complete": pa.field("structured_output_complete", pa.bool_()),
    "completions": pa.field("completions", pa.list_(COMPLETION_TYPE)),
    "logprobs": pa.field("logprobs", LOGPROBS_TYPE),
    "embedding": _LINE_EMBEDDINGS.fields()[0],
    "truncated": _LINE_EMBEDDINGS.fields()[1],
    DUPLICATE_OF: pa.field(DUPLICATE_OF, pa.string()),
    ADAPTER: pa.field(ADAPTER, pa.string()),
    IMAGE_TOKENS: pa.field(IMAGE_TOKENS, pa.int64(), nullable=False),
    REASONING_CONTENT: pa.field(REASONING_CONTENT, pa.string()),
    REASONING_TOKENS: pa.field(REASONING_TOKENS, pa.int64(), nullable=False),
    DECODE_REPLACED: pa.field(DECODE_REPLACED, pa.bool_(), nullable=False),
}
# What a copy's row bills: nothing was computed for it.
TOKEN_COLUMNS = ("prompt_tokens", "cached_tokens", "completion_tokens")
# The optional columns that count part of a row's tokens: 0 where those are.
_TOKEN_PARTS = (IMAGE_TOKENS, REASONING_TOKENS)
# With logprobs too, each completion carries its own.
_COMPLETIONS_WITH_LOGPROBS = pa.field(
    "completions",
    pa.list_(pa.struct([*COMPLETION_TYPE, pa.field("logprobs", LOGPROBS_TYPE)])),
)


def extra_columns(
    params: Sequence[SamplingParams | PoolingParams],
    *,
    has_adapters: bool = False,
    has_images: bool = False,
    reasons_apart: bool = False,
) -> tuple[str, ...]:
    """The optional result columns a job's distinct params (and LoRA adapters) call for,
    in schema order.

    A generation job whose rows include pooling ones (an OpenAI batch file with
    /v1/embeddings lines) gains `embedding` and `truncated`; a pooling job has its
    task's columns in its schema already (all its params are pooling ones).
    """
    sampling = [p for p in params if isinstance(p, SamplingParams)]
    extras = []
    if any(p.structured_outputs is not None for p in sampling):
        extras.append("structured_output_complete")
    if any(p.n > 1 for p in sampling):
        extras.append("completions")
    if any(p.logprobs is not None for p in sampling):
        extras.append("logprobs")
    if sampling and len(sampling) < len(params):
        extras += ["embedding", "truncated"]
    if has_adapters:
        extras.append(ADAPTER)
    if has_images:
        extras.append(IMAGE_TOKENS)
    if reasons_apart:
        extras += [REASONING_CONTENT, REASONING_TOKENS]
    return tuple(extras)


def result_schema(
    task: str = GENERATE, extras: Sequence[str] = (), layout: PoolingLayout | None = None
) -> pa.Schema:
    """The schema of a `task` job's results (before passthrough columns), with the
    optional columns `extras` (`extra_columns` of the job's params) after its own; a
    pooling job's columns are its `layout`'s (default: its task's, embeddings of any
    size)."""
    if task in POOLING_JOB_TASKS:
        base = [*RESULT_SCHEMA, *(layout or PoolingLayout(task)).fields()]
    else:
        base = SCORE_RESULT_SCHEMA if task == SCORE else RESULT_SCHEMA
    fields = [EXTRA_FIELDS[name] for name in extras]
    if "logprobs" in extras and "completions" in extras:
        fields = [_COMPLETIONS_WITH_LOGPROBS if f.name == "completions" else f for f in fields]
    return pa.schema([*base, *fields])


def reserved_columns(task: str = GENERATE) -> tuple[str, ...]:
    """Names a passthrough column may not take: the task's result columns and every
    optional one."""
    return (*result_schema(task).names, *EXTRA_FIELDS)


def check_passthrough(names: Sequence[str], *, task: str = GENERATE) -> None:
    """Raise ValueError if passthrough columns clash with result columns or repeat."""
    reserved = reserved_columns(task)
    clash = [n for n in names if n in reserved]
    if clash:
        raise ValueError(
            f"passthrough column(s) {', '.join(map(repr, clash))} clash with result columns "
            f"({', '.join(reserved)})"
        )
    if len(set(names)) != len(names):
        raise ValueError("passthrough columns repeat")


def result_record(
    row: PromptRow,
    output: RequestOutput | None,
    *,
    task: str = GENERATE,
    logprobs: LogprobsColumn | None = None,
) -> dict:
    """One result row as a dict, from a prompt row and (if it ran) its engine output;
    `logprobs` builds the logprobs column's values (None: the job has none)."""
    if row.error is not None:
        return _error_record(row.id, row.error)
    if output is None:
        return _error_record(row.id, "no output from the engine")
    if isinstance(output, PoolingOutput):
        return _pooled_record(row, output)
    if task == SCORE:
        return _score_record(row, output)
    reason = output.finish_reason if output.outputs else "error"
    if output.error is not None or reason not in FINISH_REASONS or reason == "error":
        return _error_record(row.id, output.error or f"engine finished with {reason!r}")
    completions = [_completion(c) for c in output.outputs]
    if logprobs is not None:
        for record, completion in zip(completions, output.outputs):
            record["logprobs"] = logprobs(row.params_index, completion)
    return {
        "id": row.id,
        "output": output.text,
        "finish_reason": reason,
        "prompt_tokens": int(output.prompt_tokens),
        "cached_tokens": int(output.cached_tokens),
        "completion_tokens": int(output.completion_tokens),
        "error": None,
        "structured_output_complete": output.structured_output_complete,
        "completions": completions,
        "logprobs": completions[0].get("logprobs"),
        REASONING_CONTENT: output.outputs[0].reasoning_content,
        REASONING_TOKENS: output.outputs[0].reasoning_tokens or 0,
    }


def _completion(completion: CompletionOutput) -> dict:
    return {
        "index": completion.index,
        "output": completion.text,
        "finish_reason": completion.finish_reason,
        "structured_output_complete": completion.structured_output_complete,
    }


def _score_record(row: PromptRow, output: RequestOutput) -> dict:
    if output.error is not None or output.prompt_logprobs is None:
        return _error_record(row.id, output.error or "the engine returned no prompt scores")
    total, perplexity = prompt_score(output.prompt_token_ids, output.prompt_logprobs)
    return {
        "id": row.id,
        "output": None,
        "finish_reason": SCORE_FINISH_REASON,
        "prompt_tokens": int(output.prompt_tokens),
        "cached_tokens": int(output.cached_tokens),
        "completion_tokens": int(output.completion_tokens),  # 0: nothing is sampled
        "error": None,
        "prompt_logprob_sum": total,
        "perplexity": perplexity,
    }


def _pooled_record(row: PromptRow, output: PoolingOutput) -> dict:
    """A pooling row's columns every job has (a pooling job adds its task's columns
    column-wise; a generation job's OpenAI embeddings line gets `embedding` here)."""
    if output.error is not None or output.data is None:
        return _error_record(row.id, output.error or "the engine returned no pooled value")
    return {
        "id": row.id,
        "output": None,
        "finish_reason": output.task,
        "prompt_tokens": int(output.prompt_tokens),
        "cached_tokens": int(output.cached_tokens),
        "completion_tokens": 0,
        "error": None,
        "embedding": output.data.tolist(),
        "truncated": bool(row.truncated),
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


def logprobs_column(llm: Any, params: Sequence[SamplingParams]) -> LogprobsColumn | None:
    """The `logprobs` column's builder for a job's params on `llm` (None: none asks)."""
    if not any(getattr(p, "logprobs", None) is not None for p in params):  # pooling: none
        return None
    return LogprobsColumn(llm.tokenizer.token_bytes, params)


def build_results(
    rows: Sequence[PromptRow],
    outputs: Mapping[int, RequestOutput],
    *,
    passthrough: pa.Table | None = None,
    task: str = GENERATE,
    extras: Sequence[str] = (),
    logprobs: LogprobsColumn | None = None,
    adapters: Sequence[str | None] = (),
    layout: PoolingLayout | None = None,
    copies: Mapping[int, tuple[int, str]] | None = None,
) -> pa.Table:
    """A results table for `rows`, in their order.

    Args:
        rows: the prompt rows (good and bad), in the order the table should have.
        outputs: engine output by row index, for the rows that ran.
        passthrough: columns to carry over, one row per entry of `rows`, same order;
            a `decode_replaced` column among them goes before the others.
        task: the job's task: its rows and schema (`result_schema`).
        extras: optional columns (`extra_columns` of the job's params).
        logprobs: builds the `logprobs` column (needed when it is among the extras).
        adapters: each lora index's adapter name (None: the base model), for the
            `adapter` column.
        layout: a pooling job's layout (its embedding size and dtype, label names).
        copies: row index -> (source row index, source id) of rows that take an
            identical row's answer (`pipelines/dedupe.py`); extras must then hold
            duplicate_of.

    Returns:
        A table with the task's result columns, the extras, then the passthrough columns.
    """
    if "logprobs" in extras and logprobs is None:
        raise ValueError("a logprobs column needs its LogprobsColumn")
    copies = copies or {}
    if copies:  # a copy's answer (and vectors) are its source's
        outputs = {
            **outputs,
            **{i: outputs[src] for i, (src, _) in copies.items() if src in outputs},
        }

    def record(row: PromptRow) -> dict:
        output = outputs.get(row.row_index)
        result = result_record(row, output, task=task, logprobs=logprobs)
        if IMAGE_TOKENS in extras:  # an error row billed none
            result[IMAGE_TOKENS] = (
                getattr(output, "image_tokens", 0) if result["prompt_tokens"] else 0
            )
        if REASONING_TOKENS in extras:  # an error row wrote none
            result.setdefault(REASONING_TOKENS, 0)
        if row.row_index in copies:
            result.update(dict.fromkeys((*TOKEN_COLUMNS, *_TOKEN_PARTS), 0))
            result[DUPLICATE_OF] = copies[row.row_index][1]
        return result

    records = [record(r) for r in rows]
    if ADAPTER in extras:
        for row, rec in zip(rows, records):
            rec[ADAPTER] = adapters[row.lora_index]
    if task in POOLING_JOB_TASKS:
        # Vectors are built column-wise (pipelines/pooling.py): a shard's embeddings
        # are one array, never a Python float each.
        layout = layout or PoolingLayout(task)
        table = pa.Table.from_pylist(
            [{k: r[k] for k in RESULT_COLUMNS} for r in records], schema=RESULT_SCHEMA
        )
        errors = [r["error"] for r in records]
        for field, column in zip(layout.fields(), pooling_columns(rows, outputs, layout, errors)):
            table = table.append_column(field, column)
        table = _with_extras(table, records, extras)
    else:
        table = pa.Table.from_pylist(records, schema=result_schema(task, extras))
    return _with_passthrough(table, passthrough, task=task)


def _with_passthrough(table: pa.Table, passthrough: pa.Table | None, *, task: str) -> pa.Table:
    """`table` then the passthrough columns, `decode_replaced` first (as its result
    field: non-null bool), so a copy shard's part has its compute shards' schema."""
    if passthrough is not None and DECODE_REPLACED in passthrough.column_names:
        flags = passthrough[DECODE_REPLACED].cast(pa.bool_()).fill_null(False)
        table = table.append_column(EXTRA_FIELDS[DECODE_REPLACED], flags)
        passthrough = passthrough.drop_columns([DECODE_REPLACED])
    if passthrough is not None and passthrough.num_columns:
        if passthrough.num_rows != table.num_rows:
            raise ValueError(
                f"passthrough has {passthrough.num_rows} rows for {table.num_rows} results"
            )
        check_passthrough(passthrough.column_names, task=task)
        for name in passthrough.column_names:
            table = table.append_column(passthrough.schema.field(name), passthrough[name])
    return table


def _with_extras(table: pa.Table, records: list[dict], extras: Sequence[str]) -> pa.Table:
    for name in extras:
        field = EXTRA_FIELDS[name]
        table = table.append_column(field, pa.array([r.get(name) for r in records], field.type))
    return table


def copy_results(
    sources: pa.Table,
    copies: Sequence[tuple[str, str]],
    *,
    task: str = GENERATE,
    extras: Sequence[str] = (DUPLICATE_OF,),
    layout: PoolingLayout | None = None,
    passthrough: pa.Table | None = None,
) -> pa.Table:
    """The result rows of copies, from their sources' result rows (`pipelines/dedupe.py`).

    Args:
        sources: result rows holding every source named in `copies` (any extra rows
            or columns are ignored).
        copies: (copy id, source id) per copy, in the order of the table to build.
        task: the job's task.
        extras: the job's optional columns, duplicate_of among them.
        layout: a pooling job's layout (as for `build_results`).
        passthrough: the copies' own passthrough columns, one row per copy (as for
            `build_results`).

    Returns:
        Each source's row with the copy's id, zero tokens, `duplicate_of` = the source's
        id, then the copies' passthrough columns.

    Raises:
        KeyError: a source id that `sources` does not hold.
    """
    schema = result_schema(task, extras, layout)
    position = {rid: i for i, rid in enumerate(sources["id"].to_pylist())}
    take = pa.array([position[source] for _, source in copies], pa.int64())
    table = sources.select([n for n in schema.names if n in sources.column_names]).take(take)
    zeros = pa.array([0] * len(copies), pa.int64())
    columns = {
        "id": pa.array([copy for copy, _ in copies], pa.string()),
        DUPLICATE_OF: pa.array([source for _, source in copies], pa.string()),
        **dict.fromkeys((*TOKEN_COLUMNS, *_TOKEN_PARTS), zeros),
    }
    arrays = [
        columns[f.name]
        if f.name in columns
        else table[f.name]
        if f.name in table.column_names
        else pa.nulls(len(copies), f.type)
        for f in schema
    ]
    result = pa.Table.from_arrays(arrays, schema=schema)
    if ERROR_CODE in sources.column_names:  # a stopped source's rows: so are its copies'
        result = result.append_column(ERROR_CODE, sources[ERROR_CODE].take(take))
    return _with_passthrough(result, passthrough, task=task)


def latencies(outputs: Mapping[int, RequestOutput]) -> list[float]:
    """Per-request latencies (seconds) of the requests that were served."""
    values = []
    for out in outputs.values():
        latency = out.metrics.latency if out.metrics is not None else None
        if out.error is None and latency is not None:
            values.append(float(latency))
    return values
