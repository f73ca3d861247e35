"""The job definition: every option of a tokenmill job, declared once, in `OPTIONS`.

Each `Option` states a name, a value type, a default, help text, the constraints on
its values, the surfaces that show it, whether an OpenAI batch line may override it
per row, and where its value goes. Every surface is derived from this table:

    surface                                   derived in
    `tokenmill run`, `flow run`, `serve`      tokenmill/cli/options.py (click options)
    the batch_inference flow's parameters     flows/parameters.py (signature + docstring,
                                              from which Prefect builds its schema)
    JobSpec's fields (kept equal by a test),  pipelines/spec.py, pipelines/job.py
    run_job's keywords
    tokenmill.generate's keywords             pipelines/notebook.py (tokenmill.score's:
                                              the same, less the sampling section)
    OpenAI batch per-row overrides            `per_row_fields()`
    SamplingParams / Prices / TemplateSpec /  `routed(values, to)`, `llm_options(values)`,
    LLM(...) arguments                        `generation_params(values)` (structured output
                                              options become one StructuredOutputs)

Values are checked here, by `check_options`, the same way whichever surface they came
from (the CLI's ranges and the flow's schema are built from the same bounds, so a bad
value is refused there even earlier). How options combine - an OpenAI batch output
needs OpenAI batch input, a system prompt needs the chat template - is checked where
the combination means something: `JobSpec` and `TemplateSpec`.

Defaults are a batch tool's: greedy decoding (temperature 0, where SamplingParams'
own default is 1.0), so a rerun or a resumed job reproduces its answers; prompts to
answer go through the model's chat template when it has one, text to score is scored
as it is (`raw` chooses either way; `pipelines/scoring.py`).

How to add an option
--------------------
Append one `Option(...)` to `OPTIONS`, then use it: the CLI flag, the flow parameter
(typed and documented), the run_job and generate keyword and, with `per_row=True`, the
OpenAI batch override all follow (tests/pipelines/test_options.py adds a throwaway
option and sees each of them). An option of the JOB surface also gets its typed line
in JobSpec (`name: type = job_option("name")`, pipelines/spec.py), so that type
checkers and IDEs see it; a test keeps JobSpec's fields and the JOB options equal.
"Use it" means reading `spec.<name>` where it matters - or, for an option with
`to=PRICES`, `PROMPT` or `ENGINE`, adding the field of that name to Prices,
TemplateSpec or an `LLM(...)` argument, which then receives it with no further edit.
Two kinds of option are declared where their values go, not here: an engine setting
is a field of `EngineConfig` (`job=True` makes it an option), and a sampling option is
a field of `SamplingParams` declared with `param(..., job=JobOption(...))`. The vocabulary an entry is written in - surfaces, value
types, `Option`'s fields - is in `pipelines/option_types.py`: a new kind of value (say,
JSON given inline or as a file) is one `ValueType` there; a repeatable option sets
`repeatable=True`; mutually exclusive options share an `exclusive` group name.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from tokenmill.connectors.decoding import ON_DECODE_ERROR
from tokenmill.connectors.formats import FORMATS
from tokenmill.engine import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MODEL,
    FIELD_DEFAULT,
    REASONING_EFFORTS,
    SamplingParams,
    StructuredOutputs,
    engine_settings,
    setting_choices,
)
from tokenmill.pipelines.option_types import (
    BATCH,
    BOOL,
    CHARACTER,
    COSTS,
    ENCODING,
    ENGINE,
    EVERYWHERE,
    FILE_TEXT,
    FLOAT,
    FLOW,
    INPUT,
    INT,
    JSON,
    KEY_VALUES,
    MODEL,
    NOTEBOOK,
    POOL,
    PRICES,
    PROMPT,
    PROMPTS,
    PYTHON,
    RUN,
    SAMPLE,
    SAMPLING,
    STRUCTURED,
    TEXT,
    TOKEN_BIAS,
    Option,
    ValueType,
    choice,
)
from tokenmill.pipelines.plan import DEFAULT_PLAN_WINDOW_ROWS, DEFAULT_SHARD_TOKENS
from tokenmill.pipelines.pooling import EMBEDDING_DTYPES, TRUNCATE
from tokenmill.pipelines.scoring import TASKS


def _engine_options() -> tuple[Option, ...]:
    """The engine settings marked as job options (`EngineConfig`, `job=True`), each as an
    option: its name, default and help come from the setting's declaration, its choices
    from the registry that owns them."""
    choices = setting_choices()
    return tuple(
        Option(
            setting.name,
            choice(*choices[setting.name]) if setting.name in choices else TEXT,
            setting.default,
            setting.metadata["help"],
            MODEL,
            to=ENGINE,
        )
        for setting in engine_settings()
        if setting.metadata["job"]
    )


def _sampling_options() -> tuple[Option, ...]:
    """The SamplingParams fields a job offers (`param(..., job=JobOption(...))`), each as
    an option: its name, type, default and help come from the field's declaration, how a
    job takes it from the field's JobOption."""
    options = []
    for param in fields(SamplingParams):
        job = param.metadata.get("job")
        if job is None:
            continue
        value_type, repeatable = _sampling_value_type(param)
        default = param.default if param.default is not MISSING else None
        options.append(
            Option(
                param.name,
                value_type,
                default if job.default is FIELD_DEFAULT else job.default,
                param.metadata["help"],
                SAMPLE,
                surfaces=EVERYWHERE if job.everywhere else PYTHON,
                to=SAMPLING,
                per_row=job.per_row,
                repeatable=repeatable,
                ge=job.ge,
                gt=job.gt,
                le=job.le,
                metavar=job.metavar,
            )
        )
    return tuple(options)


# A SamplingParams field's annotation -> (its option's value type, whether repeatable).
_SAMPLING_TYPES = {
    "int": (INT, False),
    "int | None": (INT, False),
    "float": (FLOAT, False),
    "bool": (BOOL, False),
    "list[str]": (TEXT, True),
    "list[int]": (INT, True),
    "list[int] | None": (INT, True),
    "dict[int, float] | None": (TOKEN_BIAS, False),
}


def _sampling_value_type(param: Field) -> tuple[ValueType, bool]:
    if param.type not in _SAMPLING_TYPES:
        raise TypeError(
            f"SamplingParams.{param.name}: no job option type for {param.type!r}; add it to "
            "_SAMPLING_TYPES"
        )
    return _SAMPLING_TYPES[param.type]


OPTIONS: tuple[Option, ...] = (
    # -- what the job does ---------------------------------------------------------------
    Option(
        "task",
        choice(*TASKS),
        "generate",
        "generate: answer each row. score: generate nothing; give each row's prompt "
        "log-probability sum and perplexity (text is scored as it is unless --chat). "
        "embed: each row's embedding; classify: its label and class probabilities; "
        "rerank: the relevance score of (query_column, text) - with an embedding, "
        "classification or cross-encoder model.",
        RUN,
        surfaces=BATCH,
    ),
    # -- the model ----------------------------------------------------------------------
    Option(
        "model",
        TEXT,
        None,
        f"Model directory, .gguf file, alias, or Hugging Face Hub repo id org/name "
        f"(default: {DEFAULT_MODEL}).",
        MODEL,
        to=ENGINE,
        path="if_exists",
    ),
    Option(
        "revision",
        TEXT,
        None,
        "Branch, tag or commit of a Hub repo id given as the model (default: main); the "
        "commit it resolves to names the model in the ledger and the job id.",
        MODEL,
        to=ENGINE,
    ),
    Option(
        "lora",
        KEY_VALUES,
        None,
        "A LoRA adapter rows may run with, NAME=PATH_OR_REPO: a PEFT adapter directory or "
        "a Hub repo id (org/name, org/name@revision). Rows choose one by --lora-column; "
        "OpenAI batch lines by body.model. Checked against the model before any compute.",
        MODEL,
        flag="--lora",
        metavar="NAME=PATH_OR_REPO",
        path="if_exists",
    ),
    # -- reading the input ---------------------------------------------------------------
    Option(
        "format",
        TEXT,
        None,
        f"Input format: {', '.join(FORMATS)} (default: from file names). json is a "
        "top-level array of objects or JSON Lines, told by its first byte; tsv is csv "
        "with tabs.",
        INPUT,
        surfaces=BATCH,
    ),
    Option(
        "prompt_column",
        TEXT,
        "prompt",
        "Column holding the prompt text.",
        INPUT,
        to=PROMPT,
        nullable=True,
        metavar="COL",
    ),
    Option(
        "messages_column",
        TEXT,
        None,
        "Column holding chat messages (a list of {role, content}), rendered with the "
        "model's chat template.",
        INPUT,
        to=PROMPT,
        exclusive="prompt source",
        metavar="COL",
    ),
    Option(
        "template",
        TEXT,
        None,
        'Prompt template over columns, e.g. "Summarise: {text}".',
        INPUT,
        to=PROMPT,
        exclusive="prompt source",
    ),
    Option(
        "id_column",
        TEXT,
        None,
        "Column of unique row ids (default: ids from row position, row-000000000...).",
        INPUT,
        to=PROMPT,
        metavar="COL",
    ),
    Option(
        "passthrough",
        TEXT,
        None,
        "Input columns copied into the results (tokenmill.generate keeps every input "
        "column unless given).",
        INPUT,
        repeatable=True,
        metavar="COL",
    ),
    Option(
        "lora_column",
        TEXT,
        None,
        "Column naming each row's LoRA adapter (a --lora NAME); null or empty runs the "
        "base model, and a name that is not an adapter makes the row an error.",
        INPUT,
        metavar="COL",
    ),
    Option(
        "query_column",
        TEXT,
        None,
        "rerank: the column holding each row's query; the row's prompt column (or "
        "template) is the document it is scored with.",
        INPUT,
        metavar="COL",
    ),
    Option(
        "image_column",
        TEXT,
        None,
        "Column holding each row's image, or a list of them: encoded bytes (Parquet "
        "binary), a local path (under an --image-root) or a URL (of a scheme in "
        "--allow-url-schemes); a vision model places them before the prompt text (raw "
        "text and templates may place them with the model's begin-of-image marker).",
        INPUT,
        metavar="COL",
    ),
    Option(
        "image_root",
        TEXT,
        None,
        "A directory local image paths may be read under (resolved, links followed); a "
        "path outside every root is an error row. None given: no local path is read.",
        INPUT,
        repeatable=True,
        metavar="DIR",
        path="if_exists",
    ),
    Option(
        "allow_url_schemes",
        TEXT,
        None,
        "URL schemes images may be fetched from (e.g. https, s3), with the job's storage "
        "options; none by default. Private, loopback and link-local addresses are always "
        "refused. data: URLs need no scheme allowed.",
        INPUT,
        repeatable=True,
        metavar="SCHEME",
    ),
    Option(
        "max_image_pixels",
        INT,
        DEFAULT_MAX_IMAGE_PIXELS,
        "The most pixels an image may have (read from its header); a larger image, a "
        "decompression bomb included, is an error row. Default: Pillow's MAX_IMAGE_PIXELS.",
        INPUT,
        to=ENGINE,
        ge=1,
    ),
    Option("limit", INT, None, "Only the first N input rows.", INPUT, surfaces=BATCH, ge=1),
    Option(
        "encoding",
        ENCODING,
        "utf-8",
        "Text encoding of JSONL, CSV and OpenAI batch input, and of prompt, id or template "
        "columns stored as bytes (Parquet binary, bytes in a DataFrame), e.g. latin-1, "
        "cp1252, utf-16.",
        INPUT,
    ),
    Option(
        "csv_delimiter",
        CHARACTER,
        None,
        "Field delimiter of csv and tsv input, one character: ';', '|', '\\t' for a tab "
        "(default: a comma for csv, a tab for tsv, .tsv and .tab files).",
        INPUT,
        surfaces=BATCH,
    ),
    Option(
        "csv_quote",
        CHARACTER,
        '"',
        "Quote character of csv and tsv input.",
        INPUT,
        surfaces=BATCH,
    ),
    Option(
        "on_decode_error",
        choice(*ON_DECODE_ERROR),
        "error-row",
        "A row whose bytes are not valid in the encoding: error-row makes it an error row "
        "naming its file and line; replace puts U+FFFD for the bad bytes, answers the row "
        "and marks it true in a decode_replaced result column.",
        INPUT,
    ),
    # -- how rows become prompts ------------------------------------------------------------
    Option(
        "system",
        TEXT,
        None,
        "System prompt for every row, sent with it through the model's chat template.",
        PROMPTS,
        to=PROMPT,
    ),
    Option(
        "raw",
        BOOL,
        None,
        "Send prompt or template text as it is (--raw), or as a user message through the "
        "model's chat template (--chat). Default: chat to generate, raw to score; a model "
        "without a chat template always runs raw.",
        PROMPTS,
        to=PROMPT,
        flag="--raw/--chat",
    ),
    Option(
        "reasoning_effort",
        choice(*REASONING_EFFORTS),
        None,
        "How long a reasoning model thinks, given to its chat template (gpt-oss's reads "
        "it); refused for a model whose template does not. An OpenAI batch line's own "
        "reasoning_effort wins.",
        PROMPTS,
        to=PROMPT,
    ),
    Option(
        "allow_special_tokens",
        BOOL,
        False,
        "Let special-token strings in the data (<|im_start|> in a prompt, message, query "
        "or template field value) become the model's control tokens. By default they are "
        "encoded as plain text: only the chat template's markup, the template's own text "
        "and token ids make control tokens.",
        PROMPTS,
        to=PROMPT,
    ),
    # -- sampling -----------------------------------------------------------------------------
    *_sampling_options(),
    Option(
        "max_n",
        INT,
        128,
        "The most completions a row may ask for: a row (an OpenAI batch line's body.n) "
        "asking for more is an error row naming n and this limit, OpenAI's 128 by default.",
        SAMPLE,
        ge=1,
    ),
    # -- structured outputs (at most one; each output must match it) ---------------------------
    Option(
        "json_schema",
        JSON,
        None,
        "Every output is JSON valid against this JSON schema (inline JSON or a file). "
        "Results then carry structured_output_complete: false for an output cut short.",
        SAMPLE,
        to=STRUCTURED,
        field="json",
        exclusive="structured output",
    ),
    Option(
        "regex",
        TEXT,
        None,
        "Every output matches this regular expression.",
        SAMPLE,
        to=STRUCTURED,
        exclusive="structured output",
        metavar="PATTERN",
    ),
    Option(
        "choice",
        TEXT,
        None,
        "Every output is exactly one of these strings.",
        SAMPLE,
        to=STRUCTURED,
        repeatable=True,
        exclusive="structured output",
        metavar="VALUE",
    ),
    Option(
        "grammar",
        FILE_TEXT,
        None,
        "Every output matches this grammar (Lark or llama.cpp GBNF); the command line "
        "reads it from FILE, Python and flows take its text.",
        SAMPLE,
        to=STRUCTURED,
        exclusive="structured output",
    ),
    Option(
        "json_object",
        BOOL,
        False,
        "Every output is a JSON object (any keys).",
        SAMPLE,
        to=STRUCTURED,
        exclusive="structured output",
    ),
    Option(
        "json_schema_column",
        TEXT,
        None,
        "Column holding each row's own JSON schema (an object or its JSON text); null or "
        "empty leaves the row unconstrained, and a row whose schema is invalid becomes an "
        "error row while the rest run.",
        INPUT,
        exclusive="structured output",
        metavar="COL",
    ),
    Option(
        "parse",
        BOOL,
        False,
        "With a JSON schema or json_object: add a `parsed` struct column holding each "
        "complete output's fields (null where the output is incomplete or an error).",
        SAMPLE,
        surfaces=frozenset({NOTEBOOK}),
    ),
    # -- pooling: embed, classify and rerank jobs (pipelines/pooling.py) ---------------------
    Option(
        "dimensions",
        INT,
        None,
        "embed: keep the first N values of each embedding and normalise it again "
        "(Matryoshka models); default: all of them.",
        POOL,
        ge=1,
    ),
    Option(
        "normalize",
        BOOL,
        None,
        "embed: unit-normalise embeddings (default: as the model's sentence-transformers "
        "modules say).",
        POOL,
        flag="--normalize/--no-normalize",
    ),
    Option(
        "embedding_dtype",
        choice(*EMBEDDING_DTYPES),
        "float32",
        "embed: the embedding column's storage type (float16 halves the output).",
        POOL,
    ),
    Option(
        "prompt_name",
        TEXT,
        None,
        "embed: put the model's named prompt (config_sentence_transformers.json, e.g. "
        "query) before each text.",
        POOL,
        metavar="NAME",
    ),
    Option(
        "truncate",
        choice(*TRUNCATE),
        "end",
        "embed, classify, rerank: a text longer than the model's max_seq_length is cut at "
        "the end as sentence-transformers does (truncated: true in the results), or with "
        "never becomes an error row.",
        POOL,
    ),
    # -- costs --------------------------------------------------------------------------------
    Option(
        "price_input",
        FLOAT,
        None,
        "USD per 1M uncached prompt tokens (default: not set, charged 0).",
        COSTS,
        surfaces=BATCH,
        to=PRICES,
        field="input_per_1m",
        ge=0,
    ),
    Option(
        "price_cached",
        FLOAT,
        None,
        "USD per 1M cached prompt tokens (default: the input price).",
        COSTS,
        surfaces=BATCH,
        to=PRICES,
        field="cached_input_per_1m",
        ge=0,
    ),
    Option(
        "price_output",
        FLOAT,
        None,
        "USD per 1M completion tokens (default: not set, charged 0).",
        COSTS,
        surfaces=BATCH,
        to=PRICES,
        field="output_per_1m",
        ge=0,
    ),
    Option(
        "price_device_hour",
        FLOAT,
        None,
        "USD per device-hour, for the device-time cost.",
        COSTS,
        surfaces=BATCH,
        to=PRICES,
        field="device_per_hour",
        ge=0,
    ),
    # -- running the job ------------------------------------------------------------------------
    Option(
        "shard_tokens",
        INT,
        DEFAULT_SHARD_TOKENS,
        "Token budget of one shard (prompt + max completion tokens), the unit of resume.",
        RUN,
        surfaces=BATCH,
        ge=1,
    ),
    Option(
        "plan_window_rows",
        INT,
        DEFAULT_PLAN_WINDOW_ROWS,
        "Input rows ordered and cut into shards together; planning memory grows with "
        "this, not with the input.",
        RUN,
        surfaces=BATCH,
        ge=1,
    ),
    Option(
        "resume",
        BOOL,
        True,
        "Skip shards already complete in the output; off recomputes everything.",
        RUN,
        surfaces=BATCH,
    ),
    Option(
        "dedupe",
        BOOL,
        True,
        "Compute rows whose prompt and sampling parameters are identical once, when their "
        "answer is deterministic (greedy, or a seed); each copy gets the answer, its "
        "`duplicate_of` column names the row computed, and it bills no tokens.",
        RUN,
    ),
    Option(
        "dry_run",
        BOOL,
        False,
        "Plan the job and forecast it - rows, prompt and cached tokens (exact), completion "
        "tokens, cost and duration - without computing it; only OUTPUT/_forecast.json is "
        "written, which the job's ledger later shows beside the actuals.",
        RUN,
        surfaces=BATCH,
        flag="--dry-run/--no-dry-run",
    ),
    Option(
        "calibrate",
        BOOL,
        True,
        "With dry_run: time a short run of a sample of the job's own rows (at most 5% of "
        "them, about 30 s) to estimate completion tokens and duration; off, the forecast "
        "gives the exact and bounded figures only and loads no model.",
        RUN,
        surfaces=BATCH,
    ),
    Option(
        "output_format",
        choice("parquet", "jsonl", "openai-batch"),
        "parquet",
        "Result parts as Parquet or JSONL; openai-batch also writes OUTPUT/results.jsonl "
        "in OpenAI's batch output format (it needs OpenAI batch input).",
        RUN,
        surfaces=BATCH,
    ),
    Option(
        "ledger_dataset",
        TEXT,
        None,
        "Where the job's ledger row is appended (default: OUTPUT/ledger/; the CLI reads "
        "TOKENMILL_LEDGER_DATASET).",
        RUN,
        surfaces=BATCH,
        envvar="TOKENMILL_LEDGER_DATASET",
        metavar="URL",
        path="always",
    ),
    Option(
        "storage_options",
        KEY_VALUES,
        None,
        "fsspec storage options for input, output and ledger. A flow's parameters are "
        "stored in plain text: credentials go in storage_secret or the workers' "
        "environment.",
        RUN,
        surfaces=BATCH,
        flag="--storage-option",
        repr=False,
    ),
    Option(
        "storage_secret",
        TEXT,
        None,
        "Prefect Secret block holding storage options with credentials (a JSON object), "
        "merged over storage_options when the run starts.",
        RUN,
        surfaces=frozenset({FLOW}),
        metavar="BLOCK",
    ),
    # -- the engine: its job settings (engine/types/config.py), then any other as engine_options -------
    *_engine_options(),
    Option(
        "engine_options",
        KEY_VALUES,
        None,
        "Any other engine setting (see help(tokenmill.LLM)), e.g. "
        "kv_cache_memory=268435456 or max_num_seqs=128.",
        MODEL,
        flag="--engine-option",
    ),
)

# Options that were removed, and what to do instead (a clearer error than "unknown").
_REMOVED = {
    "chat": "prompts go through the chat template by default now; raw=True sends them as they are",
    "sampling": "give the sampling options themselves (max_tokens=..., temperature=...)",
    "prices": "give price_input=, price_cached=, price_output=, price_device_hour=",
}


def options_for(surface: str) -> list[Option]:
    """The options a surface shows, in definition order."""
    return [option for option in OPTIONS if surface in option.surfaces]


def get_option(name: str) -> Option:
    """The option called `name` (KeyError if there is none)."""
    for option in OPTIONS:
        if option.name == name:
            return option
    raise KeyError(name)


def per_row_fields() -> tuple[str, ...]:
    """The options an OpenAI batch line may override for its own row."""
    return tuple(option.name for option in OPTIONS if option.per_row)


def check_options(values: Mapping[str, Any], *, surface: str) -> dict[str, Any]:
    """Every option of `surface`: the given values checked and made canonical, the rest
    defaulted.

    Args:
        values: option name -> value, as given by a caller (a subset).
        surface: JOB, NOTEBOOK, FLOW or CLI: which options may be given.

    Returns:
        name -> value for every option of the surface, in definition order.

    Raises:
        TypeError: a name that is not an option of `surface`.
        ValueError: a value of the wrong type, out of bounds, or two options given
            that exclude each other.
    """
    check_names(values, surface=surface)
    known = options_for(surface)
    checked = {
        option.name: option.check(values.get(option.name, option.default)) for option in known
    }
    _check_exclusive(known, checked)
    return checked


def check_names(names: Iterable[str], *, surface: str) -> None:
    """Raise TypeError for a name that is not an option of `surface`, saying what to give
    instead (a removed option's replacement, or the closest name)."""
    known = {option.name for option in options_for(surface)}
    for name in names:
        if name not in known:
            raise TypeError(_unknown_message(name, known))


def routed(values: Mapping[str, Any], to: str) -> dict[str, Any]:
    """The values of the options that go to `to`, under their names there."""
    return {
        option.target: values[option.name]
        for option in OPTIONS
        if option.to == to and option.name in values
    }


def generation_params(values: Mapping[str, Any]) -> SamplingParams:
    """The SamplingParams of a generation job's checked option values: the SAMPLING
    options, with the structured output options as its `structured_outputs` (a job's
    params, task included, come from `spec.sampling_params`)."""
    sampling = routed(values, SAMPLING)
    max_n = values.get("max_n")
    if max_n is not None and sampling.get("n", 1) > max_n:
        raise ValueError(f"n={sampling['n']} is over the limit of {max_n} (max_n)")
    if sampling.get("allowed_token_ids") == ():  # the repeatable option left unset: no limit
        sampling["allowed_token_ids"] = None
    return SamplingParams(**sampling, structured_outputs=structured_outputs(values))


def structured_outputs(values: Mapping[str, Any]) -> StructuredOutputs | None:
    """The one structured output option given, as StructuredOutputs (None: none given)."""
    given = {k: v for k, v in routed(values, STRUCTURED).items() if v not in (None, (), False)}
    if not given:
        return None
    if "choice" in given:
        given["choice"] = list(given["choice"])
    return StructuredOutputs(**given)


def llm_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """`LLM(...)` keyword arguments: the ENGINE options, then `engine_options`.

    Raises:
        ValueError: engine_options sets an argument that is an option of its own.
    """
    options = routed(values, ENGINE)
    extra = dict(values.get("engine_options") or {})
    clash = sorted(set(extra) & set(options))
    if clash:
        raise ValueError(
            f"engine_options may not set {', '.join(clash)}: give it as its own option"
        )
    return {**options, **extra}


def _check_exclusive(known: list[Option], values: Mapping[str, Any]) -> None:
    groups: dict[str, list[str]] = {}
    for option in known:
        if option.exclusive is not None and values[option.name] != option.check(option.default):
            groups.setdefault(option.exclusive, []).append(option.name)
    for given in groups.values():
        if len(given) > 1:
            raise ValueError(
                f"give either {' or '.join(given)}, not both"
                if len(given) == 2
                else f"give at most one of {', '.join(given)}"
            )


def _unknown_message(name: str, names: set[str]) -> str:
    if name in _REMOVED:
        return f"{name!r} is not an option any more: {_REMOVED[name]}"
    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown option {name!r}{hint}"


def annotation_of(option: Option) -> Any:
    """The Python type of an option's value: a tuple for a repeatable one, `| None`
    where None is a value."""
    annotation = option.type.annotation
    if option.repeatable:
        annotation = tuple[annotation, ...]
    return annotation | None if option.accepts_none else annotation


def takes_options(
    surface: str,
    *,
    annotate: Callable[[Option], Any] = annotation_of,
    skip_sections: Iterable[str] = (),
) -> Callable[[Callable], Callable]:
    """Decorator: a function taking `**options` shows the surface's options, keyword-only
    with their defaults, in its signature (help(), IDEs, `inspect.signature`, and
    Prefect, which builds a flow's parameter schema from it).

    Args:
        surface: whose options.
        annotate: an option -> its annotation in the signature.
        skip_sections: leave out the options of these sections (the function refuses
            them itself, e.g. `tokenmill.score` the sampling options).
    """
    skipped = set(skip_sections)

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        taken = {p.name for p in own}
        options = [
            inspect.Parameter(
                option.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=option.default,
                annotation=annotate(option),
            )
            for option in options_for(surface)
            if option.name not in taken and option.section not in skipped
        ]
        function.__signature__ = signature.replace(parameters=[*own, *options])
        return function

    return decorate
