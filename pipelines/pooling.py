"""Pooling jobs (`task` embed, classify, rerank): each row's embedding, class
probabilities or relevance score; nothing is generated.

A pooling row runs through the engine as a pooling request (`LLM.encode` with
`PoolingParams`): its prompt is computed once and pooled (engine/pooling/pooler.py);
no token is sampled, so there is no completion to bill. Its result row has the
columns every job has - `output` null, `finish_reason` the task's name ("error" for an
error row), `prompt_tokens`, `cached_tokens` (an encoder caches nothing; a decoder's
shared prefixes are served from its prefix cache), `completion_tokens` 0, `error` -
and then its task's own:

    embed     embedding   fixed-size list of float32 (or float16 with
                          embedding_dtype="float16"), one per row: what LanceDB,
                          DuckDB's FLOAT[n] and polars' Array read directly; its size
                          is the model's embedding, or `dimensions` (Matryoshka: the
                          first n values, normalised again)
    classify  label       the likeliest label's name (config.json's id2label)
              probs       list of float32, one probability per label, in id2label order
    rerank    score       float64: the cross-encoder's score of (query, document)
    all       truncated   bool: the text was cut to the model's max_seq_length

What is pooled. Text goes to the model as it is (no chat template: `raw` is implied,
and system prompts and messages columns are refused), after the model's named prompt
when `prompt_name` is given ("query" for Qwen3-Embedding-style models). A rerank row is
the pair (its `query_column` value, its prompt or template text).

Bad input. A text longer than the model's max_seq_length (sentence-transformers'
sentence_bert_config.json, else its context) is cut at the end as sentence-transformers
cuts it, and marked `truncated: true`; with `truncate="never"` it is an error row
instead. A null, empty or whitespace-only text (or query) is an error row, as in every
job: sentence-transformers would embed an empty string as the bare "[CLS] [SEP]"
sequence, a vector that means nothing, so it is refused rather than silently answered
(`LLM.embed("")` still embeds it as the library does).

Cost. Prompt tokens at the input price (cached ones at the cached price), no
completion tokens; the ledger's throughput counts tokens and rows per second.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tokenmill.engine import (
    CLASSIFY,
    EMBED,
    POOLING_TASKS,
    RERANK,
    EncodedText,
    PoolingOutput,
    PoolingParams,
    PoolingTokenizer,
)
from tokenmill.pipelines.templating import RenderedRow, check_text
from tokenmill.pipelines.tokenize import PromptRow

POOLING_JOB_TASKS = POOLING_TASKS
TRUNCATE = ("end", "never")  # the `truncate` option's choices
EMBEDDING_DTYPES = {"float32": pa.float32(), "float16": pa.float16()}
# Options that only pooling jobs take, and the task each belongs to (None: any).
POOLING_OPTIONS: Mapping[str, str | None] = {
    "dimensions": EMBED,
    "normalize": EMBED,
    "embedding_dtype": EMBED,
    "prompt_name": EMBED,
    "query_column": RERANK,
    "truncate": None,
}


def pooling_params(values: Mapping[str, Any]) -> PoolingParams:
    """The engine parameters of a pooling job's rows, from its option values."""
    task = values["task"]
    if task != EMBED:
        return PoolingParams(task)
    return PoolingParams(
        task, dimensions=values.get("dimensions"), normalize=values.get("normalize")
    )


def check_pooling_options(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Raise ValueError for pooling options a job cannot use: any of them outside a
    pooling job, one of another pooling task, a rerank job without its query column,
    and chat rendering (pooled text goes to the model as it is).

    Args:
        values: checked option values (`task` absent means generate).
        defaults: each option's checked default, to tell what was given.
    """
    task = values.get("task", "generate")
    given = [n for n in POOLING_OPTIONS if n in values and values[n] != defaults.get(n)]
    if task not in POOLING_TASKS:
        if given:
            raise ValueError(
                f"{', '.join(given)}: options of embed, classify and rerank jobs; this job's "
                f"task is {task}"
            )
        return
    wrong = [n for n in given if POOLING_OPTIONS[n] not in (None, task)]
    if wrong:
        raise ValueError(
            f"{', '.join(wrong)}: not an option of a {task} job "
            f"({', '.join(f'{n}: {POOLING_OPTIONS[n]}' for n in wrong)})"
        )
    if task == RERANK and not values.get("query_column"):
        raise ValueError("a rerank job needs query_column: the column holding each row's query")
    if values.get("messages_column") or values.get("system") or values.get("raw") is False:
        raise ValueError(
            f"a {task} job pools text as it is: drop messages_column, system and --chat "
            "(prompt_name puts the model's own instruction before each text)"
        )


@dataclass(frozen=True)
class PoolingLayout:
    """How a job's results hold its pooled values (the same for every part of a job)."""

    task: str
    # embed: values per embedding - the fixed size of the column; None: rows may differ
    # (an OpenAI batch file, whose lines each ask their own `dimensions`).
    embedding_size: int | None = None
    embedding_dtype: str = "float32"
    label_names: tuple[str, ...] = ()  # classify: the head's labels, in probs order

    def fields(self) -> list[pa.Field]:
        """The task's result columns, after the columns every job has."""
        truncated = pa.field("truncated", pa.bool_())
        if self.task == EMBED:
            dtype = EMBEDDING_DTYPES[self.embedding_dtype]
            kind = (
                pa.list_(dtype, self.embedding_size)
                if self.embedding_size is not None
                else pa.list_(dtype)
            )
            return [pa.field("embedding", kind), truncated]
        if self.task == CLASSIFY:
            return [
                pa.field("label", pa.string()),
                pa.field("probs", pa.list_(pa.float32())),
                truncated,
            ]
        return [pa.field("score", pa.float64()), truncated]


def pooling_columns(
    rows: Sequence[PromptRow],
    outputs: Mapping[int, PoolingOutput],
    layout: PoolingLayout,
    errors: Sequence[str | None],
) -> list[pa.Array]:
    """The task's columns for `rows` (in their order), built column-wise.

    Args:
        rows: the result rows' prompt rows.
        outputs: engine output by row index.
        layout: the job's layout.
        errors: each row's error (None for a good row): an error row's values are null.

    Returns:
        One array per field of `layout.fields()`.
    """
    good = [i for i, e in enumerate(errors) if e is None]
    truncated = pa.array(
        [bool(row.truncated) if e is None else None for row, e in zip(rows, errors)], pa.bool_()
    )
    data = [outputs[rows[i].row_index].data for i in good]
    if layout.task == EMBED:
        return [_embedding_column(data, good, len(rows), layout), truncated]
    values: list[Any] = [None] * len(rows)
    if layout.task == CLASSIFY:
        labels: list[str | None] = [None] * len(rows)
        for i, tensor in zip(good, data):
            values[i] = tensor.tolist()
            best = int(tensor.argmax())
            names = layout.label_names
            labels[i] = names[best] if best < len(names) else str(best)
        return [pa.array(labels, pa.string()), pa.array(values, pa.list_(pa.float32())), truncated]
    for i, tensor in zip(good, data):
        values[i] = float(tensor[0])
    return [pa.array(values, pa.float64()), truncated]


def _embedding_column(data, good: list[int], num_rows: int, layout: PoolingLayout) -> pa.Array:
    dtype = np.float16 if layout.embedding_dtype == "float16" else np.float32
    arrow_type = layout.fields()[0].type
    if layout.embedding_size is None:  # sizes may differ row to row
        values: list[Any] = [None] * num_rows
        for i, tensor in zip(good, data):
            values[i] = tensor.numpy().astype(dtype)
        return pa.array(values, arrow_type)
    size = layout.embedding_size
    matrix = np.zeros((num_rows, size), dtype)
    for i, tensor in zip(good, data):
        matrix[i] = tensor.numpy()
    mask = np.ones(num_rows, bool)
    mask[good] = False
    return pa.FixedSizeListArray.from_arrays(
        pa.array(matrix.reshape(-1)), size, mask=pa.array(mask) if len(good) < num_rows else None
    )


def tokenize_pooling_rows(
    tokenizer: PoolingTokenizer,
    rendered: Sequence[RenderedRow],
    *,
    truncate: str = "end",
    prefix: str = "",
    queries: Sequence[Any] | None = None,
    params_index: Sequence[int] | int = 0,
    allow_special_tokens: bool = False,
) -> list[PromptRow]:
    """Encode rendered rows for pooling: cut to max_seq_length (or refused), each row
    marked `truncated`; with `queries`, each row is the pair (query, its text).

    Args:
        tokenizer: the model's pooling tokenizer (engine/loader/pooling_tokenizer.py).
        rendered: rows from `render_rows`; error rows pass through unchanged.
        truncate: "end" cuts over-long texts, "never" makes them error rows.
        prefix: text put before each row's text (the model's named prompt).
        queries: each row's query (rerank), same order as `rendered`.
        params_index: each row's params index (one for all, or per row).
        allow_special_tokens: a query's special-token strings become tokens (by default
            they are data, encoded as text - as the rows' `data_spans` are).

    Returns:
        One PromptRow per rendered row, same order.
    """
    n = len(rendered)
    indices = [params_index] * n if isinstance(params_index, int) else list(params_index)
    problems: dict[int, str] = {}
    if queries is not None:
        for i, query in enumerate(queries):
            problem = check_text(query, "query")
            if problem is not None and rendered[i].error is None:
                problems[i] = problem
    todo = [i for i, r in enumerate(rendered) if r.error is None and i not in problems]
    texts = [prefix + rendered[i].text for i in todo]
    # The prefix (the model's named prompt) is markup; the spans move past it.
    spans = [
        tuple((a + len(prefix), b + len(prefix)) for a, b in rendered[i].data_spans) for i in todo
    ]
    cut = truncate != "never"
    if not todo:  # every row failed already (the model may not even pool)
        encoded = []
    elif queries is None:
        encoded = tokenizer.encode(texts, truncate=cut, data_spans=spans)
    else:
        asked = [queries[i] for i in todo]
        find = tokenizer.special_text.find
        encoded = tokenizer.encode_pairs(
            asked,
            texts,
            truncate=cut,
            query_spans=None if allow_special_tokens else [find(q) for q in asked],
            document_spans=spans,
        )
    by_row: dict[int, EncodedText] = dict(zip(todo, encoded))
    rows = []
    for i, r in enumerate(rendered):
        error = r.error or problems.get(i)
        found = by_row.get(i)
        if error is None and found is not None:
            error = found.error or (None if found.token_ids else "prompt encodes to no tokens")
        if error is not None:
            rows.append(PromptRow(r.row_index, r.id, error=error, params_index=indices[i]))
        else:
            rows.append(
                PromptRow(
                    r.row_index,
                    r.id,
                    token_ids=array("i", found.token_ids),
                    params_index=indices[i],
                    truncated=found.truncated,
                )
            )
    return rows


@dataclass(frozen=True)
class PoolingInputs:
    """What reading a job's rows needs to know of its model's pooling."""

    tokenizer: PoolingTokenizer  # cuts texts to the model's max_seq_length
    tasks: tuple[str, ...]  # what the model serves (generate, embed, classify, rerank)
    embedding_size: int | None  # values per embedding before `dimensions`
    prefix: str = ""  # the model's named prompt, put before every text (`prompt_name`)
    label_names: tuple[str, ...] = ()

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if dimensions is None or self.embedding_size is None:
            return None
        if dimensions > self.embedding_size:
            return (
                f"dimensions={dimensions} is more than the model's "
                f"{self.embedding_size}-value embedding"
            )
        return None


def served_error(url_task: str, endpoint: str, tasks: Sequence[str], model: str) -> str | None:
    """The error of an OpenAI batch line the model cannot serve, or None."""
    if url_task in tasks:
        return None
    return (
        f"model {model} does not serve {endpoint} (it serves {', '.join(tasks) or 'nothing'}): "
        "run this file's other lines with a model that serves both, or split the file"
    )
