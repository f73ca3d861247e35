"""Input batches -> windows of tokenized prompt rows, with the job-level checks on ids.

Streams the source batch by batch: each batch is templated and batch-encoded as it
arrives, and its rows are handed on in windows of `plan_window_rows` consecutive rows.
Window k holds rows k*W .. (k+1)*W - 1 whatever the source's batch sizes, so the same
input always gives the same windows. Per-row problems (bad prompt, unparseable line,
invalid per-row sampling params, over-long prompt) become error rows; problems with
the job as a whole (null or duplicate ids) raise ValueError after the last window, so
the message can count them - still before any compute.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pyarrow as pa

from tokenmill.connectors import ERROR_COLUMN, REPLACED_COLUMN
from tokenmill.connectors.batches import ReadCounts
from tokenmill.connectors.openai_embeddings import is_embeddings_url
from tokenmill.connectors.openai_tools import AUTO, renders_hermes_tools
from tokenmill.engine import EMBED, PoolingParams, StructuredOutputs
from tokenmill.pipelines.adapters import JobAdapter, row_adapters
from tokenmill.pipelines.ids import IdCheck
from tokenmill.pipelines.images import RowImageReader, RowImages, read_row_images
from tokenmill.pipelines.options import per_row_fields
from tokenmill.pipelines.pooling import (
    POOLING_JOB_TASKS,
    PoolingInputs,
    served_error,
    tokenize_pooling_rows,
)
from tokenmill.pipelines.results import DECODE_REPLACED
from tokenmill.pipelines.scoring import GENERATE, adds_generation_prompt, min_prompt_tokens
from tokenmill.pipelines.spec import UNCHANGED, JobSpec, ParamsTable
from tokenmill.pipelines.templating import (
    ChatRenderer,
    RenderedRow,
    message_image_urls,
    render_rows,
    row_ids,
)
from tokenmill.pipelines.tokenize import (
    PromptRow,
    chat_renderer,
    special_strings,
    tokenize_rows,
)


@dataclass
class Window:
    """Consecutive input rows, tokenized: the unit of planning.

    `passthrough`, `endpoints` and `tool_calls` hold one entry per row, in input order
    (row `r` is at `r.row_index - start`).
    """

    index: int
    start: int  # row index of the window's first row
    rows: list[PromptRow] = field(default_factory=list)
    # The job's passthrough columns, after `decode_replaced` when the job replaces bytes.
    passthrough: pa.Table | None = None
    endpoints: list[str | None] | None = None  # OpenAI batch: each row's request url
    # OpenAI batch: how each row's answer is read as tool calls (JSON; None: it is not).
    tool_calls: list[str | None] | None = None

    @property
    def end(self) -> int:
        """The row index after the window's last row."""
        return self.start + len(self.rows)


def read_windows(
    source: Any,
    spec: JobSpec,
    tokenizer: Any,
    *,
    max_model_len: int,
    params: ParamsTable,
    pooling: PoolingInputs | None = None,
    adapters: list[JobAdapter] | None = None,
    counts: ReadCounts | None = None,
    images: RowImageReader | None = None,
) -> Iterator[Window]:
    """Read, template and tokenize the input (up to `spec.limit`), window by window.

    Args:
        source: an opened connectors Source (`iter_batches()`, `uri`).
        spec: the job (`plan_window_rows` sizes the windows).
        tokenizer: the model's tokenizer (`encode_batch`, `apply_chat_template`).
        max_model_len: the model's context length.
        params: the job's distinct sampling params; rows' overrides are added to it.
        pooling: the model's pooling inputs (a pooling job, or OpenAI batch input with
            /v1/embeddings lines); None when it serves no pooling task.
        adapters: the job's LoRA adapters (`pipelines/adapters.py`), which rows choose
            by `spec.lora_column` or an OpenAI batch line's body.model.
        counts: filled in with the rows read and the blank records skipped.
        images: reads and places the rows' images (a job with an image column).

    Yields:
        Windows in input order; row indices run 0..n-1 across them.

    Raises:
        ValueError: after the last window, if the id column has nulls or duplicates.
    """
    ids = IdCheck()
    yield from tokenized_windows(
        _batches(source, spec, counts),
        spec,
        tokenizer,
        ids=ids,
        max_model_len=max_model_len,
        params=params,
        pooling=pooling,
        adapters=adapters,
        images=images,
    )
    ids.check(
        id_column=spec.id_column,
        source=source.uri,
        id_batches=lambda: (_ids_of(b, spec, s) for s, b in _batches(source, spec)),
    )


class IdSink(Protocol):
    """Takes the rows' ids as they are read (`ids.IdCheck`, or a spread planning part's
    hash buckets); a null among them stops the templating."""

    num_nulls: int

    def add(self, ids: Sequence[str | None], first_row: int) -> None: ...


def tokenized_windows(
    batches: Iterable[tuple[int, pa.RecordBatch]],
    spec: JobSpec,
    tokenizer: Any,
    *,
    ids: IdSink,
    max_model_len: int,
    params: ParamsTable,
    pooling: PoolingInputs | None = None,
    adapters: list[JobAdapter] | None = None,
    images: RowImageReader | None = None,
) -> Iterator[Window]:
    """`read_windows` over (first row index, batch) pairs that never cross a window's
    end (`window_batches`), the ids handed to `ids`: rows that start mid-window (a
    partition of the input) make a window of the rows from there (`Window.start`)."""
    chat = chat_renderer(tokenizer, add_generation_prompt=adds_generation_prompt(spec.task))
    size = spec.plan_window_rows
    window: Window | None = None
    passthrough: list[pa.RecordBatch] = []
    for start, batch in batches:
        if ids.num_nulls:  # the job fails: no more windows, only the nulls are counted
            ids.add(_ids_of(batch, spec, start), start)
            continue
        if window is not None and (start // size != window.index or start != window.end):
            yield _finish(window, passthrough)
            window, passthrough = None, []
        if window is None:
            window = Window(start // size, start)
            if spec.is_openai_batch:
                window.endpoints, window.tool_calls = [], []
        columns = batch.to_pydict()
        rows = _read_batch(
            columns,
            start,
            spec,
            tokenizer,
            chat,
            params,
            max_model_len,
            pooling,
            adapters or [],
            images,
        )
        ids.add([r.id for r in rows], start)
        window.rows += rows
        carried = _carried(batch, spec)
        if carried is not None:
            passthrough.append(carried)
        if window.endpoints is not None:
            window.endpoints += columns["url"]
            window.tool_calls += columns.get("tool_calls") or [None] * batch.num_rows
    if window is not None and not ids.num_nulls:
        yield _finish(window, passthrough)


def _finish(window: Window, passthrough: list[pa.RecordBatch]) -> Window:
    if passthrough:
        window.passthrough = pa.Table.from_batches(passthrough)
    return window


def _carried(batch: pa.RecordBatch, spec: JobSpec) -> pa.RecordBatch | None:
    """The columns a batch's rows carry into their results: `decode_replaced` (with
    on_decode_error="replace") and the passthrough columns; None when there are none."""
    batch_columns = batch.select(list(spec.passthrough))
    if spec.on_decode_error != "replace":
        return batch_columns if spec.passthrough else None
    flags = pa.array([False] * batch.num_rows)
    if REPLACED_COLUMN in batch.schema.names:
        flags = batch.column(REPLACED_COLUMN).fill_null(False)
    schema = pa.schema([pa.field(DECODE_REPLACED, pa.bool_()), *batch_columns.schema])
    return pa.RecordBatch.from_arrays([flags, *batch_columns.columns], schema=schema)


def _batches(
    source: Any, spec: JobSpec, counts: ReadCounts | None = None
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row index, batch), up to `spec.limit`, split where windows begin."""
    batches = source.iter_batches(limit=spec.limit, counts=counts)
    return window_batches(batches, first_row=0, window_rows=spec.plan_window_rows)


def window_batches(
    batches: Iterable[pa.RecordBatch], *, first_row: int, window_rows: int
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row index, batch) for consecutive rows from `first_row`, each batch split
    where a window of `window_rows` begins."""
    start = first_row
    for batch in batches:
        offset = 0
        while offset < batch.num_rows:
            row = start + offset
            take = min(batch.num_rows - offset, window_rows - row % window_rows)
            yield row, batch.slice(offset, take)
            offset += take
        start += batch.num_rows


def _read_batch(
    columns: dict[str, list],
    start: int,
    spec: JobSpec,
    tokenizer: Any,
    chat: ChatRenderer | None,
    params: ParamsTable,
    max_model_len: int,
    pooling: PoolingInputs | None = None,
    adapters: list[JobAdapter] | None = None,
    images: RowImageReader | None = None,
) -> list[PromptRow]:
    special = special_strings(tokenizer)
    row_images = None
    if spec.is_openai_batch and "messages" in columns:
        row_images = _line_images(columns["messages"], images)
    elif images is not None:
        row_images = read_row_images(columns[images.column], images.access)
    rendered = render_rows(
        columns,
        spec.template_spec,
        start=start,
        chat=chat,
        special=special,
        image_sizes=None if row_images is None else [r.sizes for r in row_images],
        places=None if images is None else images.places,
    )
    rendered = mark_bad_rows(rendered, columns, id_column=spec.id_column, start=start)
    if row_images is not None and not spec.is_openai_batch:
        rendered = mark_bad_images(rendered, row_images)
        rows = _generation_rows(
            columns, spec, tokenizer, params, max_model_len, rendered, adapters or []
        )
        return with_images(rows, row_images)
    if spec.task in POOLING_JOB_TASKS:
        return tokenize_pooling_rows(
            pooling.tokenizer,
            rendered,
            truncate=spec.truncate,
            prefix=pooling.prefix,
            queries=columns[spec.query_column] if spec.query_column else None,
            allow_special_tokens=spec.allow_special_tokens,
        )
    adapters = adapters or []
    if spec.is_openai_batch:
        rendered = _refuse_unread_tool_calls(rendered, columns, tokenizer)
        if row_images is not None:
            rendered = mark_bad_images(rendered, row_images)
        rows = _read_openai_rows(
            columns,
            start,
            spec,
            tokenizer,
            chat,
            params,
            max_model_len,
            pooling,
            rendered,
            adapters,
        )
        return rows if row_images is None else with_images(rows, row_images)
    return _generation_rows(columns, spec, tokenizer, params, max_model_len, rendered, adapters)


def _line_images(messages: list, images: RowImageReader | None) -> list[RowImages] | None:
    """The images of an OpenAI batch file's lines, read as the job allows (None: no line
    has any); a line with images for a model without a vision tower is an error."""
    urls = [message_image_urls(m) for m in messages]
    if not any(urls):
        return None
    if images is None:
        refused = RowImages(
            error="image parts need a vision-language model (e.g. Gemma 3); this one has no "
            "vision tower"
        )
        return [RowImages() if u is None else refused for u in urls]
    read = iter(read_row_images([u for u in urls if u], images.access))
    return [RowImages() if u is None else next(read) for u in urls]


def mark_bad_images(rendered: list[RenderedRow], images: list[RowImages]) -> list[RenderedRow]:
    """Rows whose images could not be read become error rows saying why (the images' error
    first: without them, the row's rendering failed for want of them)."""
    return [
        row if found.error is None else replace(row, text=None, error=found.error)
        for row, found in zip(rendered, images)
    ]


def with_images(rows: list[PromptRow], images: list[RowImages]) -> list[PromptRow]:
    """Each row that runs carries its images (in its plan file: a resumed job reads them
    there, not from the source again)."""
    for row, found in zip(rows, images):
        if row.token_ids is not None:
            row.images, row.image_hashes = found.data, found.hashes
    return rows


def _generation_rows(
    columns: dict[str, list],
    spec: JobSpec,
    tokenizer: Any,
    params: ParamsTable,
    max_model_len: int,
    rendered: list[RenderedRow],
    adapters: list[JobAdapter],
) -> list[PromptRow]:
    rendered, loras = lora_indices(
        columns,
        rendered,
        adapters,
        column=spec.lora_column,
        per_row=spec.is_openai_batch,
    )
    params_index = _params_index(columns, spec, params, rendered)
    indices = [i for _, i in params_index]
    return tokenize_rows(
        tokenizer,
        [r for r, _ in params_index],
        max_model_len=max_model_len,
        max_tokens=[params.params[i].max_tokens for i in indices],
        params_index=indices,
        min_prompt_tokens=min_prompt_tokens(spec.task),
        lora_index=loras,
        # An OpenAI batch line's budget is capped at the context left, as OpenAI serves
        # a max_tokens above it; a plain job's budget is the user's own: over it is an error.
        cap_budget=params.capped if spec.is_openai_batch else None,
    )


def _refuse_unread_tool_calls(
    rendered: list[RenderedRow], columns: dict[str, list], tokenizer: Any
) -> list[RenderedRow]:
    """Rows whose tool_choice "auto" this model cannot serve become error rows naming it:
    its answer is unconstrained text, read back as tool calls only in the format of a
    chat template that renders tools (`connectors/openai_tools.py`)."""
    specs = columns.get("tool_calls")
    if specs is None or renders_hermes_tools(getattr(tokenizer, "chat_template", None)):
        return rendered
    message = (
        'body.tool_choice "auto" is refused for this model: its chat template does not '
        "render tools in a format tokenmill reads back (Hermes / Qwen <tool_call>); give "
        'tool_choice "required", a named function or "none"'
    )
    return [
        replace(row, text=None, error=message)
        if row.error is None and spec is not None and json.loads(spec)["choice"] == AUTO
        else row
        for row, spec in zip(rendered, specs)
    ]


def lora_indices(
    columns: dict[str, list],
    rendered: list[RenderedRow],
    adapters: list[JobAdapter],
    *,
    column: str | None,
    per_row: bool = False,
) -> tuple[list[RenderedRow], list[int]]:
    """Each row's LoRA adapter index, from `column` (an unset cell - `is_unset` - is the
    base model; a name that is no adapter makes the row an error) or, with `per_row`
    (OpenAI batch input), from the `model` column (a name that is no adapter is the
    model itself). All 0 without adapters."""
    if not adapters or (column is None and not per_row):
        return rendered, [0] * len(rendered)
    if column is not None:
        names = [None if is_unset(name) else name for name in columns[column]]
    else:
        names = columns.get("model", [])
    if not names:
        names = [None] * len(rendered)
    chosen = row_adapters(names, adapters, strict=column is not None)
    rows = [
        row if error is None or row.error is not None else replace(row, text=None, error=error)
        for row, (_, error) in zip(rendered, chosen)
    ]
    return rows, [index for index, _ in chosen]


def _read_openai_rows(
    columns: dict[str, list],
    start: int,
    spec: JobSpec,
    tokenizer: Any,
    chat: ChatRenderer | None,
    params: ParamsTable,
    max_model_len: int,
    pooling: PoolingInputs | None,
    rendered: list[RenderedRow],
    adapters: list[JobAdapter],
) -> list[PromptRow]:
    """An OpenAI batch file's rows: each by its line's endpoint - /v1/embeddings lines
    embedded, the others generated - and an error row for an endpoint the model does
    not serve."""
    urls = columns["url"]
    tasks = pooling.tasks if pooling is not None else (GENERATE,)
    model = spec.model or "the default model"
    rows: list[PromptRow | None] = [None] * len(rendered)
    generate, embed = [], []
    for i, row in enumerate(rendered):
        is_embed = is_embeddings_url(urls[i])
        # An unreadable line has no url and keeps the reader's message; a line the
        # model cannot serve says so, whatever its rendering met.
        problem = urls[i] and served_error(EMBED if is_embed else GENERATE, urls[i], tasks, model)
        if problem:
            rendered[i] = replace(row, text=None, error=problem)
        (embed if is_embed else generate).append(i)
    if generate:
        subset = {k: [v[i] for i in generate] for k, v in columns.items()}
        for i, row in zip(
            generate,
            _generation_rows(
                subset,
                spec,
                tokenizer,
                params,
                max_model_len,
                [rendered[i] for i in generate],
                adapters,
            ),
        ):
            rows[i] = row
    if embed:
        indices = []
        for i in embed:
            dimensions = columns["dimensions"][i]
            problem = pooling.check_dimensions(dimensions) if pooling is not None else None
            if problem is not None and rendered[i].error is None:
                rendered[i] = replace(rendered[i], text=None, error=problem)
            indices.append(params.add(PoolingParams(EMBED, dimensions=dimensions)))
        embedded = tokenize_pooling_rows(
            pooling.tokenizer if pooling is not None else None,
            [rendered[i] for i in embed],
            truncate=spec.truncate,
            params_index=indices,
        )
        for i, row in zip(embed, embedded):
            rows[i] = row
    return rows


def _ids_of(batch: pa.RecordBatch, spec: JobSpec, start: int) -> list[str | None]:
    """A batch's ids, reading only the columns they come from."""
    names = [n for n in (spec.id_column, ERROR_COLUMN) if n and n in batch.schema.names]
    return _batch_ids(batch.select(names).to_pydict(), spec.id_column, start, batch.num_rows)


def _batch_ids(
    columns: dict[str, list], id_column: str | None, start: int, num_rows: int
) -> list[str | None]:
    """A batch's ids as its result rows carry them: a line the connector could not parse
    and that has no id gets its position id."""
    ids = row_ids(columns[id_column] if id_column else None, start, num_rows)
    errors = columns.get(ERROR_COLUMN)
    if errors is None:
        return ids
    return [
        row_ids(None, start + i, 1)[0] if rid is None and error is not None else rid
        for i, (rid, error) in enumerate(zip(ids, errors))
    ]


def mark_bad_rows(
    rendered: list[RenderedRow], columns: dict[str, list], *, id_column: str | None, start: int
) -> list[RenderedRow]:
    """Rows a reader could not read (a message in `columns[ERROR_COLUMN]`) become error
    rows; one whose id could not be read either gets its position id.

    Args:
        rendered: the batch's rendered rows.
        columns: the batch's columns; without ERROR_COLUMN every row was read.
        id_column: the id column, or None for position ids.
        start: the global index of the batch's first row.

    Returns:
        The rows, bad ones replaced by error rows carrying the reader's message.
    """
    errors = columns.get(ERROR_COLUMN)
    if errors is None:  # only a reader that met unreadable rows adds the column
        return rendered
    ids = _batch_ids(columns, id_column, start, len(rendered))
    return [
        row if error is None else RenderedRow(row.row_index, rid, error=error)
        for row, error, rid in zip(rendered, errors, ids)
    ]


def _params_index(
    columns: dict[str, list], spec: JobSpec, table: ParamsTable, rendered: list[RenderedRow]
) -> list[tuple[RenderedRow, int]]:
    """Each row's sampling params index; invalid per-row params (an OpenAI batch line's
    overrides or response_format, a row's own schema) make the row an error."""
    return params_indices(
        columns,
        table,
        rendered,
        per_row=spec.is_openai_batch,
        schema_column=spec.json_schema_column,
    )


def params_indices(
    columns: dict[str, list],
    table: ParamsTable,
    rendered: list[RenderedRow],
    *,
    per_row: bool = False,
    schema_column: str | None = None,
) -> list[tuple[RenderedRow, int]]:
    """Each row with its index into `table`, taking per-row settings from `columns`.

    Args:
        columns: the batch's columns.
        table: the job's distinct params; rows' own settings are added to it.
        rendered: the batch's rendered rows.
        per_row: OpenAI batch input: each row's body fields and response_format apply.
        schema_column: a column of per-row JSON schemas (unset - `is_unset` - that row is
            unconstrained).

    Returns:
        (row, params index) per row; a row whose settings are invalid becomes an error
        row (index 0).
    """
    if not per_row and schema_column is None:
        return [(r, 0) for r in rendered]
    present = [k for k in per_row_fields() if k in columns] if per_row else []
    formats = columns.get("response_format") if per_row else None
    schemas = columns[schema_column] if schema_column is not None else None
    pairs = []
    for i, row in enumerate(rendered):
        index = 0
        if row.error is None:
            try:
                structured = UNCHANGED
                if formats is not None and formats[i] is not None:
                    structured = _from_response_format(formats[i])
                elif schemas is not None:
                    structured = _from_schema_cell(schemas[i], schema_column)
                index = table.for_row({k: columns[k][i] for k in present}, structured=structured)
            except ValueError as exc:
                row = replace(row, text=None, error=str(exc))
        pairs.append((row, index))
    return pairs


def is_unset(value: Any) -> bool:
    """A per-row option cell that sets nothing: null, or text that is empty or only
    whitespace - what an empty CSV cell reads as (CSV has no null), so a CSV row leaves
    an option unset as a null does in Parquet and JSON."""
    return value is None or (isinstance(value, str) and not value.strip())


def _from_schema_cell(value: Any, column: str) -> StructuredOutputs | None:
    if is_unset(value):
        return None
    if not isinstance(value, (str, dict)):
        raise ValueError(f"{column} must hold a JSON schema (an object or its JSON text)")
    return StructuredOutputs(json=value)


def _from_response_format(text: str) -> StructuredOutputs | None:
    """An OpenAI `response_format` (checked by the connector) as the row's constraint.

    `json_schema` with `strict: true` closes every object the schema leaves open (OpenAI's
    strict mode allows no extra keys); without it the schema is still enforced, with JSON
    Schema's own meaning. `text` is unconstrained.
    """
    response_format = json.loads(text)
    kind = response_format["type"]
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format["json_schema"]
        return StructuredOutputs(
            json=spec["schema"], disable_additional_properties=bool(spec.get("strict"))
        )
    return None


def check_ids(rows: list[PromptRow], *, id_column: str | None, source: str) -> None:
    """Raise ValueError if any id is null or repeats (ids key resume and the results)."""
    ids = [r.id for r in rows]
    check = IdCheck()
    check.add(ids, 0)
    check.check(id_column=id_column, source=source, id_batches=lambda: [ids])
