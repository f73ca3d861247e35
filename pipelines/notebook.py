"""`tokenmill.generate`: answer a DataFrame's rows in a notebook, results in input order.

The same templating, tokenizing, ordering and results code as a batch job, without
shards or files: rows are submitted in prefix order (so shared prefixes are computed
once) and handed back in input order. The loaded LLM is cached per model in the
process, so calling `generate` again does not reload it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines.plan import order_rows
from tokenmill.pipelines.reading import check_ids
from tokenmill.pipelines.results import RESULT_COLUMNS, build_results
from tokenmill.pipelines.templating import TemplateSpec, render_rows, validate_columns
from tokenmill.pipelines.tokenize import chat_renderer, tokenize_rows

_LLM_CACHE: dict[tuple, Any] = {}


def get_llm(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str | None = None,
    engine_options: dict[str, Any] | None = None,
) -> Any:
    """The LLM for `model`, loaded once per process and reused.

    Args:
        model: model directory, .gguf file or alias; None = the default model.
        dtype, device, engine_options: as for `tokenmill.engine.llm.LLM`.

    Returns:
        A loaded LLM (the same object for the same arguments).
    """
    options = dict(engine_options or {})
    key = (None if model is None else str(model), dtype, device, tuple(sorted(options.items())))
    if key not in _LLM_CACHE:
        from tokenmill.engine.llm import LLM

        _LLM_CACHE[key] = LLM(model, dtype=dtype, device=device, **options)
    return _LLM_CACHE[key]


def clear_llm_cache() -> None:
    """Forget cached LLMs (frees their memory once nothing else holds them)."""
    _LLM_CACHE.clear()


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


def generate(
    data: Any,
    *,
    prompt_column: str = "prompt",
    messages_column: str | None = None,
    template: str | None = None,
    system: str | None = None,
    chat: bool = False,
    id_column: str | None = None,
    passthrough: Sequence[str] | None = None,
    model: str | None = None,
    llm: Any = None,
    dtype: str = "auto",
    device: str | None = None,
    engine_options: dict[str, Any] | None = None,
    on_output: Callable[[RequestOutput], None] | None = None,
    **sampling: Any,
) -> Any:
    """Answer every row of `data`; results come back in input order.

    Args:
        data: polars/pandas DataFrame, Arrow table, or a list of prompt strings.
        prompt_column, messages_column, template, system, chat, id_column: how rows
            become prompts, as in a batch job (see `tokenmill.pipelines.templating`).
        passthrough: input columns to keep beside the results (default: every input
            column whose name does not clash with a result column).
        model: model to load (cached per process), unless `llm` is given.
        llm: an already loaded LLM.
        dtype, device, engine_options: how to load `model`.
        on_output: called with each RequestOutput as it finishes.
        **sampling: SamplingParams fields (max_tokens, temperature=0 by default, top_p,
            seed, stop, ...).

    Returns:
        A polars DataFrame: id, output, finish_reason, prompt_tokens, cached_tokens,
        completion_tokens, error, then the passthrough columns. Bad rows have
        finish_reason "error" and a message in `error`.
    """
    import polars as pl

    table = to_arrow(data)
    params = SamplingParams(**{"temperature": 0.0, **sampling})
    if params.n != 1:
        raise ValueError("generate returns one output per row; n must be 1")
    spec = TemplateSpec(
        prompt_column=prompt_column,
        messages_column=messages_column,
        template=template,
        system=system,
        chat=chat,
        id_column=id_column,
    )
    validate_columns(spec, table.column_names, source="data")
    if passthrough is None:
        passthrough = [c for c in table.column_names if c not in RESULT_COLUMNS]
    llm = llm or get_llm(model, dtype=dtype, device=device, engine_options=engine_options)

    rendered = render_rows(table.to_pydict(), spec, chat=chat_renderer(llm.tokenizer))
    rows = tokenize_rows(
        llm.tokenizer, rendered, max_model_len=llm.max_model_len, max_tokens=params.max_tokens
    )
    if id_column is not None:
        check_ids(rows, id_column=id_column, source="data")
    good = [r for r in order_rows(rows) if r.token_ids is not None]
    outputs = {}
    if good:
        generated = llm.generate([r.token_ids for r in good], params, on_output=on_output)
        outputs = {r.row_index: o for r, o in zip(good, generated)}
    results = build_results(rows, outputs, passthrough=table.select(list(passthrough)))
    return pl.from_arrow(results)
