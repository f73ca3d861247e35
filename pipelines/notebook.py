"""`tokenmill.generate`, `tokenmill.score` and `tokenmill.embed` / `classify` / `rerank`: a
DataFrame's rows answered, scored or pooled in a notebook, results in input order;
`tokenmill.forecast`: what `generate` will cost.

The same options (`pipelines/options.py`, the NOTEBOOK surface), templating,
tokenizing, ordering and results code as a batch job, without shards or files: rows
are submitted in prefix order (so shared prefixes are computed once) and handed back
in input order. The model is the process's shared engine (`engine.llm_cache`), so
calling `generate` again - or `run_job`, or a flow task, with the same model and
engine options - does not load it again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tokenmill.connectors import ERROR_COLUMN
from tokenmill.connectors.decoding import Decoding, decode_values
from tokenmill.connectors.lines import BadLine
from tokenmill.engine import RequestOutput
from tokenmill.pipelines.adapters import (
    adapter_names,
    check_lora_option,
    describe_job_adapters,
    lora_requests,
)
from tokenmill.pipelines.dedupe import find_copies
from tokenmill.pipelines.engine_failures import generate_rows
from tokenmill.pipelines.forecast import Forecast, Work, engine_planner, forecast_work, requests_of
from tokenmill.pipelines.images import image_reader, read_row_images
from tokenmill.pipelines.option_types import JOB, NOTEBOOK, POOL, PRICES, PROMPT, SAMPLE
from tokenmill.pipelines.options import (
    OPTIONS,
    check_options,
    llm_options,
    routed,
    takes_options,
)
from tokenmill.pipelines.parsed import with_parsed
from tokenmill.pipelines.plan import order_rows
from tokenmill.pipelines.pooling import (
    CLASSIFY,
    EMBED,
    POOLING_JOB_TASKS,
    RERANK,
    PoolingLayout,
    tokenize_pooling_rows,
)
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.reading import (
    check_ids,
    lora_indices,
    mark_bad_images,
    mark_bad_rows,
    params_indices,
    with_images,
)
from tokenmill.pipelines.reasoning import (
    check_reasoning_effort,
    job_reasoning_format,
    several_completions_refusal,
    split_answers,
)
from tokenmill.pipelines.results import (
    DECODE_REPLACED,
    DUPLICATE_OF,
    build_results,
    check_passthrough,
    extra_columns,
    logprobs_column,
    reserved_columns,
)
from tokenmill.pipelines.scoring import (
    GENERATE,
    SCORE,
    adds_generation_prompt,
    min_prompt_tokens,
)
from tokenmill.pipelines.spec import ParamsTable, resolve_task, sampling_params
from tokenmill.pipelines.templating import (
    TemplateSpec,
    render_rows,
    required_columns,
    validate_columns,
)
from tokenmill.pipelines.tokenize import (
    PromptRow,
    chat_renderer,
    special_strings,
    tokenize_rows,
)


def to_arrow(data: Any) -> pa.Table:
    """A polars/pandas DataFrame, polars LazyFrame, Arrow table/batch or list of strings
    (or of bytes, decoded later by the job's encoding) as an Arrow table; a list becomes
    a single `prompt` column."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, (list, tuple)):
        is_bytes = [isinstance(v, (bytes, bytearray, memoryview)) for v in data]
        if not any(is_bytes):
            return pa.table({"prompt": pa.array(list(data), pa.string())})
        if not all(b or v is None for b, v in zip(is_bytes, data)):
            raise TypeError(
                "data mixes text and bytes prompts: give all str, or all bytes (decoded "
                "with the encoding option)"
            )
        return pa.table(
            {"prompt": pa.array([None if v is None else bytes(v) for v in data], pa.binary())}
        )
    module = type(data).__module__.split(".")[0]
    if module == "polars":
        if hasattr(data, "collect"):  # LazyFrame
            data = data.collect()
        return data.to_arrow()
    if module == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    raise TypeError(
        "data must be a polars or pandas DataFrame, a pyarrow Table or a list of strings, "
        f"got {type(data).__name__}"
    )


@takes_options(NOTEBOOK, skip_sections=(POOL,))
def generate(
    data: Any,
    *,
    llm: Any = None,
    on_output: Callable[[RequestOutput], None] | None = None,
    **options: Any,
) -> Any:
    """Answer every row of `data`; results come back in input order.

    Args:
        data: polars/pandas DataFrame, Arrow table, or a list of prompt strings.
        llm: an already loaded LLM (default: the shared engine for `model`, `dtype`,
            `device` and `engine_options`).
        on_output: called with each RequestOutput as it finishes.
        **options: the job options a notebook takes (as the signature lists them):
            how rows become prompts (prompt_column, template, system, raw, ...), the
            sampling options (max_tokens, temperature=0 ...), structured outputs
            (json_schema, regex, choice, grammar, json_object, json_schema_column; with
            parse=True the JSON fields come back as a `parsed` struct column), and the
            model and engine options. `passthrough` names the input columns kept beside
            the results (default: every input column whose name is not a result column's).

    Returns:
        A polars DataFrame: id, output, finish_reason, prompt_tokens, cached_tokens,
        completion_tokens, error, then structured_output_complete (and `parsed`) with
        structured outputs, `completions` with n > 1, then the passthrough columns. Bad
        rows have finish_reason "error" and a message in `error`.

    Raises:
        ValueError: bad options, a missing column, or a structured outputs constraint
            that is invalid or cannot be enforced (before any compute; a bad schema in
            json_schema_column fails only its row).
    """
    return _run(data, GENERATE, llm=llm, on_output=on_output, options=options)


@takes_options(NOTEBOOK, skip_sections=(SAMPLE, POOL))
def score(
    data: Any,
    *,
    llm: Any = None,
    on_output: Callable[[RequestOutput], None] | None = None,
    **options: Any,
) -> Any:
    """Score every row's text by the model's log-probabilities; results in input order.

    Nothing is generated. Text is scored as it is unless `raw=False`, which scores it as
    a user message through the chat template (`pipelines/scoring.py` says exactly what
    is scored).

    Args:
        data: polars/pandas DataFrame, Arrow table, or a list of texts.
        llm: an already loaded LLM (default: the shared engine for `model`, `dtype`,
            `device` and `engine_options`).
        on_output: called with each RequestOutput as it finishes.
        **options: the job options a notebook takes, less the sampling ones (as the
            signature lists them). `passthrough` as for `generate`.

    Returns:
        A polars DataFrame: id, output (null), finish_reason ("score"), prompt_tokens,
        cached_tokens, completion_tokens (0), error, prompt_logprob_sum (over every
        token but the first), perplexity (exp(-prompt_logprob_sum / (prompt_tokens - 1))),
        then the passthrough columns. Bad rows have finish_reason "error", a message in
        `error` and null scores.
    """
    return _run(data, SCORE, llm=llm, on_output=on_output, options=options)


@takes_options(NOTEBOOK, skip_sections=(SAMPLE,))
def embed(
    data: Any,
    column: str | None = None,
    *,
    llm: Any = None,
    on_output: Callable[[Any], None] | None = None,
    **options: Any,
) -> Any:
    """Embed every row's text with an embedding model; results in input order.

    Args:
        data: polars/pandas DataFrame, Arrow table, or a list of texts.
        column: the column holding the text (the `prompt_column` option; a template
            works too).
        llm: an already loaded LLM (default: the shared engine for `model`, ...).
        on_output: called with each PoolingOutput as it finishes.
        **options: the job options a notebook takes, less the sampling ones: model,
            dimensions, normalize, embedding_dtype, prompt_name, truncate, ...
            (`pipelines/pooling.py` says what is embedded and how bad rows end).

    Returns:
        A polars DataFrame: id, output (null), finish_reason ("embed"), prompt_tokens,
        cached_tokens, completion_tokens (0), error, embedding (Array(Float32, n)),
        truncated, then the input's columns. Bad rows have finish_reason "error" and a
        null embedding.
    """
    return _run(data, EMBED, llm=llm, on_output=on_output, options=_column(options, column))


@takes_options(NOTEBOOK, skip_sections=(SAMPLE,))
def classify(
    data: Any,
    column: str | None = None,
    *,
    llm: Any = None,
    on_output: Callable[[Any], None] | None = None,
    **options: Any,
) -> Any:
    """Classify every row's text with a sequence-classification model; results in
    input order, with `label` (config.json's id2label) and `probs` (one per label)."""
    return _run(data, CLASSIFY, llm=llm, on_output=on_output, options=_column(options, column))


@takes_options(NOTEBOOK, skip_sections=(SAMPLE,))
def rerank(
    data: Any,
    column: str | None = None,
    *,
    llm: Any = None,
    on_output: Callable[[Any], None] | None = None,
    **options: Any,
) -> Any:
    """Score every (query, text) row with a cross-encoder; results in input order, with
    `score`. The `query_column` option (as for a rerank job) names the column holding each
    row's query, `column` its document."""
    return _run(data, RERANK, llm=llm, on_output=on_output, options=_column(options, column))


def _column(options: dict[str, Any], column: str | None) -> dict[str, Any]:
    if column is None:
        return options
    if options.get("prompt_column") not in (None, column):
        raise ValueError("give column or prompt_column, not both")
    return {**options, "prompt_column": column}


@dataclass
class _Prepared:
    """A DataFrame's rows ready for the engine."""

    values: dict[str, Any]  # the checked options
    table: pa.Table
    passthrough: list[str]
    llm: Any
    lock: Any
    params: ParamsTable
    rows: list[PromptRow]  # every row, in input order
    copies: dict[int, int]  # copy row index -> source row index (dedupe)
    replaced: list[bool] | None  # rows whose input bytes were replaced (or None)
    layout: PoolingLayout | None  # a pooling task's results layout
    adapters: list  # the LoRA adapters rows may choose (pipelines/adapters.py)
    reasoning: str | None  # how answers are split into reasoning and text (or None)

    @property
    def computed(self) -> list[PromptRow]:
        """The rows the engine computes, in the order it runs them."""
        return order_rows([r for r in self.rows if r.row_index not in self.copies])


def _run(
    data: Any,
    task: str,
    *,
    llm: Any,
    on_output: Callable[[RequestOutput], None] | None,
    options: dict[str, Any],
) -> Any:
    """`generate`, `score` or a pooling task: the rows of `data` through the engine, in
    input order."""
    import polars as pl

    job = _prepare(data, task, llm=llm, options=options)
    with job.lock:
        outputs = generate_rows(
            job.llm,
            job.computed,
            job.params.params,
            on_output=on_output,
            loras=lora_requests(job.adapters) if job.adapters else None,
        )
    split_answers(job.llm, job.reasoning, outputs)
    ids = [r.id for r in job.rows]  # row_index is the position in `data`
    extras = extra_columns(
        job.params.params,
        has_adapters=bool(job.adapters),
        has_images=any(r.images for r in job.rows) or job.values["image_column"] is not None,
        reasons_apart=job.reasoning is not None,
    )
    extras += (DUPLICATE_OF,) if job.copies else ()
    carried = job.table.select(list(job.passthrough))
    if job.replaced is not None:
        carried = carried.add_column(0, DECODE_REPLACED, pa.array(job.replaced, pa.bool_()))
    results = build_results(
        job.rows,
        outputs,
        passthrough=carried,
        task=task,
        extras=extras,
        adapters=adapter_names(job.adapters),
        layout=job.layout,
        copies={copy: (source, ids[source]) for copy, source in job.copies.items()},
        logprobs=logprobs_column(job.llm, job.params.params),
    )
    frame = pl.from_arrow(results)
    if job.values["parse"]:
        frame = with_parsed(frame, job.values["json_schema"])
    return frame


@takes_options(NOTEBOOK)
def forecast(
    data: Any,
    *,
    task: str = GENERATE,
    llm: Any = None,
    calibrate: bool = True,
    **options: Any,
) -> Forecast:
    """What `generate(data, **options)` - or `score`, `embed`, `classify`, `rerank` with
    `task` - will cost, before it runs (`pipelines/forecast.py`).

    The rows are templated, tokenized, deduplicated and ordered exactly as that call
    does, then forecast: prompt and cached tokens exact (for an engine whose prefix
    cache starts empty), completion tokens between their bounds, costs, and - with
    `calibrate` - estimates of completion tokens and seconds from a short run of a
    sample of the rows.

    Args:
        data: as for `generate`.
        task: generate, score, embed, classify or rerank (the call forecast; a pooling
            task's text column is the `prompt_column` option).
        llm: an already loaded LLM (default: the shared engine, loaded if needed).
        calibrate: run the calibration sample (off: exact and bounded figures only).
        **options: as for `generate`, plus the prices: price_input, price_cached,
            price_output, price_device_hour (USD per 1M tokens, per device-hour).

    Returns:
        The Forecast (`job_id` None: a notebook call is not a job).
    """
    if task not in (GENERATE, SCORE, *POOLING_JOB_TASKS):
        choices = ", ".join((GENERATE, SCORE, *POOLING_JOB_TASKS))
        raise ValueError(f"task must be one of {choices}, got {task!r}")
    prices = {name: options.pop(name) for name in _PRICE_OPTIONS if name in options}
    job = _prepare(data, task, llm=llm, options=options)
    batch = requests_of(job.computed, job.params.params)
    work = Work(
        [batch],
        rows=len(job.rows),
        rows_failed=sum(1 for r in job.rows if r.error is not None),
        rows_deduplicated=len(job.copies),
    )
    with job.lock:
        return forecast_work(
            work,
            planner=engine_planner({}, None, job.llm),
            prices=Prices(**routed(check_options(prices, surface=JOB), PRICES)),
            task=task,
            model=getattr(job.llm, "model_name", "model"),
            llm=job.llm if calibrate else None,
        )


# The job definition's price options: a notebook's generate takes none, its forecast all.
_PRICE_OPTIONS = tuple(option.name for option in OPTIONS if option.to == PRICES)
forecast.__signature__ = forecast.__signature__.replace(
    parameters=[
        *forecast.__signature__.parameters.values(),
        *(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
            for name in _PRICE_OPTIONS
        ),
    ]
)


def _prepare(data: Any, task: str, *, llm: Any, options: dict[str, Any]) -> _Prepared:
    """Check the options, load the engine if needed, and template, tokenize and
    deduplicate the rows of `data`."""
    values = check_options(options, surface=NOTEBOOK)
    values = resolve_task({**values, "task": task})
    template = TemplateSpec(**routed(values, PROMPT))
    base = sampling_params(values)
    table = to_arrow(data)
    validate_columns(template, table.column_names, source="data")
    query_column = values["query_column"]
    if query_column is not None and query_column not in table.column_names:
        raise ValueError(f"data has no column {query_column!r} (query_column)")
    schema_column = values["json_schema_column"]
    if schema_column is not None and schema_column not in table.column_names:
        raise ValueError(f"data has no column {schema_column!r} (json_schema_column)")
    if values["parse"] and not (
        values["json_schema"] is not None or values["json_object"] or schema_column
    ):
        raise ValueError("parse=True needs json_schema, json_object or json_schema_column")
    check_lora_option(values["lora"])
    if values["lora"] and task in POOLING_JOB_TASKS:
        raise ValueError(f"LoRA adapters serve generate and score jobs, not {task}")
    lora_column = values["lora_column"]
    if lora_column is not None and not values["lora"]:
        raise ValueError("lora_column names adapters: register them with lora={name: path}")
    if lora_column is not None and lora_column not in table.column_names:
        raise ValueError(f"data has no column {lora_column!r} (lora_column)")
    passthrough = values["passthrough"]
    if options.get("passthrough") is None:
        reserved = reserved_columns(task)
        passthrough = [c for c in table.column_names if c not in reserved]
    check_passthrough(passthrough, task=task)
    lock: Any = nullcontext()
    if llm is None:
        from tokenmill.pipelines.shared_llm import get_llm

        shared = get_llm(**llm_options(values))
        llm, lock = shared.llm, shared.lock

    adapters = []
    if values["lora"]:  # each checked against the model before any compute
        adapters = describe_job_adapters(
            values["lora"],
            llm.model_config,
            model_names=llm.model_names,
            max_rank=llm.engine_config.max_lora_rank,
        )
    # Split as a job splits: a chat answer's reasoning in its own column, never in `output`.
    reasoning = job_reasoning_format(task=task, raw=template.raw, tokenizer=llm.tokenizer)
    single_reason = several_completions_refusal(reasoning)
    if single_reason is not None and getattr(base, "n", 1) > 1:
        raise ValueError(single_reason)
    if template.reasoning_effort is not None:
        check_reasoning_effort(llm.tokenizer, template.reasoning_effort)
    engine = getattr(llm, "engine", None)
    params = ParamsTable(
        base,
        check=engine.compile_structured_outputs if engine else None,
        max_n=values["max_n"],
        single_reason=single_reason,
    )
    columns = table.to_pydict()
    decoding = Decoding(values["encoding"], values["on_decode_error"])
    decoded = [*required_columns(template), *([query_column] if query_column else [])]
    replaced = _decode_text_columns(columns, table.schema, decoded, decoding)
    chat = chat_renderer(llm.tokenizer, add_generation_prompt=adds_generation_prompt(task))
    images = None
    if values["image_column"] is not None:  # (an LLM stand-in without images has no model_dir)
        images = image_reader(
            values,
            model_dir=llm.model_dir,
            model_name=getattr(llm, "model_name", "the model"),
            tokenizer=llm.tokenizer,
            task=task,
            # As the engine that runs the rows crops their images (Gemma 3's pan-and-scan).
            pan_and_scan=getattr(getattr(llm, "engine_config", None), "pan_and_scan", None),
        )
    row_images = None
    if images is not None:
        if images.column not in table.column_names:
            raise ValueError(f"data has no column {images.column!r} (image_column)")
        row_images = read_row_images(columns[images.column], images.access)
    rendered = render_rows(
        columns,
        template,
        chat=chat,
        special=special_strings(llm.tokenizer),
        image_sizes=None if row_images is None else [r.sizes for r in row_images],
        places=None if images is None else images.places,
    )
    rendered = mark_bad_rows(rendered, columns, id_column=template.id_column, start=0)
    if row_images is not None:
        rendered = mark_bad_images(rendered, row_images)
    layout = None
    if task in POOLING_JOB_TASKS:
        rows, layout = _pooling_rows(llm, task, values, rendered, columns)
    else:
        rendered, loras = lora_indices(columns, rendered, adapters, column=lora_column)
        pairs = params_indices(columns, params, rendered, schema_column=schema_column)
        indices = [i for _, i in pairs]
        rows = tokenize_rows(
            llm.tokenizer,
            [r for r, _ in pairs],
            max_model_len=llm.max_model_len,
            max_tokens=[params.params[i].max_tokens for i in indices],
            params_index=indices,
            min_prompt_tokens=min_prompt_tokens(task),
            lora_index=loras,
        )
        if row_images is not None:
            rows = with_images(rows, row_images)
    if template.id_column is not None:
        check_ids(rows, id_column=template.id_column, source="data")
    copies = find_copies(rows, params.params) if values["dedupe"] else {}
    return _Prepared(
        values,
        table,
        list(passthrough),
        llm,
        lock,
        params,
        rows,
        copies,
        replaced,
        layout,
        adapters,
        reasoning,
    )


def _pooling_rows(
    llm: Any, task: str, values: dict[str, Any], rendered: list, columns: dict[str, list]
) -> tuple[list, PoolingLayout]:
    """A pooling task's rows tokenized for the loaded model, and its results layout.

    Raises:
        ValueError: the model does not serve the task, or an option it cannot honour.
    """
    if task not in llm.tasks:
        raise ValueError(f"this model serves {', '.join(llm.tasks)}, not {task}")
    prefix = llm.prompt_prefix(values["prompt_name"]) if values["prompt_name"] else ""
    size = llm.embedding_size if task == EMBED else None
    if values["dimensions"] is not None and size is not None and values["dimensions"] > size:
        raise ValueError(f"dimensions={values['dimensions']} is more than the model's {size}")
    rows = tokenize_pooling_rows(
        llm.pooling_tokenizer,
        rendered,
        truncate=values["truncate"],
        prefix=prefix,
        queries=columns[values["query_column"]] if task == RERANK else None,
        allow_special_tokens=values["allow_special_tokens"],
    )
    layout = PoolingLayout(
        task,
        embedding_size=values["dimensions"] or size,
        embedding_dtype=values["embedding_dtype"],
        label_names=llm.label_names,
    )
    return rows, layout


def _decode_text_columns(
    columns: dict[str, list], schema: pa.Schema, names: list[str], decoding: Decoding
) -> list[bool] | None:
    """Decodes, in `columns`, the binary ones among `names` (what prompts and ids come
    from), as a file's are read (`connectors/decoding.py`): a value that does not
    decode leaves its row a message in `columns[ERROR_COLUMN]`.

    Returns:
        With on_decode_error="replace", which rows had bytes replaced; else None.
    """
    num_rows = len(next(iter(columns.values()))) if columns else 0
    replaced = [False] * num_rows if decoding.replaces else None
    errors: dict[int, str] = {}
    for name in names:
        dtype = schema.field(name).type
        if not (pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype)):
            continue
        decoded = decode_values(columns[name], decoding)
        columns[name] = decoded.values
        for row, problem in decoded.errors.items():
            error = BadLine(row, f"column {name!r}: {problem}", unit="row index")
            errors.setdefault(row, str(error))
        if replaced is not None:
            replaced = [a or b for a, b in zip(replaced, decoded.replaced)]
    if errors:
        columns[ERROR_COLUMN] = [errors.get(i) for i in range(num_rows)]
    return replaced
