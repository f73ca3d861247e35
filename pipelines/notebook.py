"""`tokenmill.generate` and `tokenmill.score`: a DataFrame's rows answered (or scored) in
a notebook, results in input order.

The same options (`pipelines/options.py`, the NOTEBOOK surface), templating,
tokenizing, ordering and results code as a batch job, without shards or files: rows
are submitted in prefix order (so shared prefixes are computed once) and handed back
in input order. The model is the process's shared engine (`engine.llm_cache`), so
calling `generate` again - or `run_job`, or a flow task, with the same model and
engine options - does not load it again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pyarrow as pa

from tokenmill.engine.outputs import RequestOutput
from tokenmill.pipelines.option_types import NOTEBOOK, PROMPT, SAMPLE
from tokenmill.pipelines.options import check_options, llm_options, routed, takes_options
from tokenmill.pipelines.plan import order_rows
from tokenmill.pipelines.reading import check_ids
from tokenmill.pipelines.results import build_results, check_passthrough, result_schema
from tokenmill.pipelines.scoring import (
    GENERATE,
    SCORE,
    adds_generation_prompt,
    min_prompt_tokens,
)
from tokenmill.pipelines.spec import resolve_task, sampling_params
from tokenmill.pipelines.templating import TemplateSpec, render_rows, validate_columns
from tokenmill.pipelines.tokenize import chat_renderer, tokenize_rows


def to_arrow(data: Any) -> pa.Table:
    """A polars/pandas DataFrame, polars LazyFrame, Arrow table/batch or list of strings
    as an Arrow table; a list becomes a single `prompt` column."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, (list, tuple)):
        return pa.table({"prompt": pa.array(list(data), pa.string())})
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


@takes_options(NOTEBOOK)
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
            sampling options (max_tokens, temperature=0 ...), and the model and engine
            options. `passthrough` names the input columns kept beside the results
            (default: every input column whose name is not a result column's).

    Returns:
        A polars DataFrame: id, output, finish_reason, prompt_tokens, cached_tokens,
        completion_tokens, error, then the passthrough columns. Bad rows have
        finish_reason "error" and a message in `error`.
    """
    return _run(data, GENERATE, llm=llm, on_output=on_output, options=options)


@takes_options(NOTEBOOK, skip_sections=(SAMPLE,))
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


def _run(
    data: Any,
    task: str,
    *,
    llm: Any,
    on_output: Callable[[RequestOutput], None] | None,
    options: dict[str, Any],
) -> Any:
    """`generate` or `score`: the rows of `data` through the engine, in input order."""
    import polars as pl

    values = check_options(options, surface=NOTEBOOK)
    values = resolve_task({**values, "task": task})
    template = TemplateSpec(**routed(values, PROMPT))
    params = sampling_params(values)
    table = to_arrow(data)
    validate_columns(template, table.column_names, source="data")
    passthrough = values["passthrough"]
    if options.get("passthrough") is None:
        columns = result_schema(task).names
        passthrough = [c for c in table.column_names if c not in columns]
    check_passthrough(passthrough, task=task)
    lock: Any = nullcontext()
    if llm is None:
        from tokenmill.engine.llm_cache import get_llm

        shared = get_llm(**llm_options(values))
        llm, lock = shared.llm, shared.lock

    chat = chat_renderer(llm.tokenizer, add_generation_prompt=adds_generation_prompt(task))
    rendered = render_rows(table.to_pydict(), template, chat=chat)
    rows = tokenize_rows(
        llm.tokenizer,
        rendered,
        max_model_len=llm.max_model_len,
        max_tokens=params.max_tokens,
        min_prompt_tokens=min_prompt_tokens(task),
    )
    if template.id_column is not None:
        check_ids(rows, id_column=template.id_column, source="data")
    good = [r for r in order_rows(rows) if r.token_ids is not None]
    outputs = {}
    if good:
        with lock:
            generated = llm.generate([r.token_ids for r in good], params, on_output=on_output)
        outputs = {r.row_index: o for r, o in zip(good, generated)}
    results = build_results(rows, outputs, passthrough=table.select(list(passthrough)), task=task)
    return pl.from_arrow(results)
