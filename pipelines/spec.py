"""`JobSpec`: everything a batch job needs to know, validated before any work starts.

Its fields are the job definition's JOB options (`pipelines/options.py`), in its order,
each written here with its type so that a type checker and an IDE can follow it; its
default, help and checks are the definition's (`job_option`), and
tests/pipelines/test_options.py keeps the two lists equal. Here are the checks on how
options combine, and what they mean together: the sampling parameters, prices, prompt
rules and LLM arguments of the job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from typing import Any

from tokenmill.connectors.formats import normalize_format
from tokenmill.engine import PoolingParams, SamplingParams, StructuredOutputs
from tokenmill.pipelines.adapters import check_lora_option
from tokenmill.pipelines.option_types import JOB, PRICES, PROMPT, SAMPLING, STRUCTURED
from tokenmill.pipelines.options import (
    OPTIONS,
    check_options,
    generation_params,
    get_option,
    llm_options,
    per_row_fields,
    routed,
)
from tokenmill.pipelines.plan import params_key
from tokenmill.pipelines.pooling import (
    POOLING_JOB_TASKS,
    POOLING_OPTIONS,
    check_pooling_options,
    pooling_params,
)
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.results import check_passthrough
from tokenmill.pipelines.scoring import GENERATE, SCORE, default_raw, scoring_params
from tokenmill.pipelines.templating import TemplateSpec

OPENAI_ID_COLUMN = "custom_id"


def job_option(name: str) -> Any:
    """A JobSpec field for the job option `name`: keyword-only, with the definition's
    default (checked and made canonical in __post_init__)."""
    option = get_option(name)
    return field(default=option.default, repr=option.repr)


@dataclass
class JobSpec:
    """A batch job: input, output, and every JOB option of the job definition.

    Args:
        input: dataset URL or path (Parquet, JSONL, CSV, OpenAI batch; any fsspec URL).
        output: the job's output directory URL or path.
        **options: the job options, keyword-only (`pipelines/options.py` lists them
            with their defaults and help).

    Raises:
        TypeError: an unknown option.
        ValueError: a bad value, or options that do not go together.
    """

    input: str
    output: str
    _: KW_ONLY
    task: str = job_option("task")
    model: str | None = job_option("model")
    revision: str | None = job_option("revision")
    lora: dict[str, Any] | None = job_option("lora")
    format: str | None = job_option("format")
    prompt_column: str | None = job_option("prompt_column")
    messages_column: str | None = job_option("messages_column")
    template: str | None = job_option("template")
    id_column: str | None = job_option("id_column")
    passthrough: tuple[str, ...] | None = job_option("passthrough")
    lora_column: str | None = job_option("lora_column")
    query_column: str | None = job_option("query_column")
    image_column: str | None = job_option("image_column")
    image_root: tuple[str, ...] | None = job_option("image_root")
    allow_url_schemes: tuple[str, ...] | None = job_option("allow_url_schemes")
    max_image_pixels: int = job_option("max_image_pixels")
    limit: int | None = job_option("limit")
    encoding: str = job_option("encoding")
    csv_delimiter: str | None = job_option("csv_delimiter")
    csv_quote: str = job_option("csv_quote")
    on_decode_error: str = job_option("on_decode_error")
    system: str | None = job_option("system")
    raw: bool | None = job_option("raw")
    reasoning_effort: str | None = job_option("reasoning_effort")
    allow_special_tokens: bool = job_option("allow_special_tokens")
    max_tokens: int = job_option("max_tokens")
    min_tokens: int = job_option("min_tokens")
    temperature: float = job_option("temperature")
    top_p: float = job_option("top_p")
    top_k: int = job_option("top_k")
    min_p: float = job_option("min_p")
    seed: int | None = job_option("seed")
    stop: tuple[str, ...] | None = job_option("stop")
    stop_token_ids: tuple[int, ...] | None = job_option("stop_token_ids")
    ignore_eos: bool = job_option("ignore_eos")
    include_stop_str_in_output: bool = job_option("include_stop_str_in_output")
    n: int = job_option("n")
    logprobs: int | None = job_option("logprobs")
    repetition_penalty: float = job_option("repetition_penalty")
    presence_penalty: float = job_option("presence_penalty")
    frequency_penalty: float = job_option("frequency_penalty")
    logit_bias: dict[int, float] | None = job_option("logit_bias")
    allowed_token_ids: tuple[int, ...] | None = job_option("allowed_token_ids")
    bad_words: tuple[str, ...] | None = job_option("bad_words")
    max_n: int = job_option("max_n")
    json_schema: dict[str, Any] | str | None = job_option("json_schema")
    regex: str | None = job_option("regex")
    choice: tuple[str, ...] | None = job_option("choice")
    grammar: str | None = job_option("grammar")
    json_object: bool = job_option("json_object")
    json_schema_column: str | None = job_option("json_schema_column")
    dimensions: int | None = job_option("dimensions")
    normalize: bool | None = job_option("normalize")
    embedding_dtype: str = job_option("embedding_dtype")
    prompt_name: str | None = job_option("prompt_name")
    truncate: str = job_option("truncate")
    price_input: float | None = job_option("price_input")
    price_cached: float | None = job_option("price_cached")
    price_output: float | None = job_option("price_output")
    price_device_hour: float | None = job_option("price_device_hour")
    shard_tokens: int = job_option("shard_tokens")
    plan_window_rows: int = job_option("plan_window_rows")
    resume: bool = job_option("resume")
    dedupe: bool = job_option("dedupe")
    dry_run: bool = job_option("dry_run")
    calibrate: bool = job_option("calibrate")
    output_format: str = job_option("output_format")
    ledger_dataset: str | None = job_option("ledger_dataset")
    storage_options: dict[str, Any] | None = job_option("storage_options")
    dtype: str = job_option("dtype")
    device: str | None = job_option("device")
    quantization: str | None = job_option("quantization")
    kv_cache_dtype: str = job_option("kv_cache_dtype")
    engine_options: dict[str, Any] | None = job_option("engine_options")

    def __post_init__(self) -> None:
        if not self.input or not self.output:
            raise ValueError("input and output must be given")
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.kw_only}
        for name, value in resolve_task(check_options(options, surface=JOB)).items():
            setattr(self, name, value)
        self.output = self.output.rstrip("/") or "/"
        if self.format is not None:
            self.format = normalize_format(self.format)
        if self.task == SCORE:
            _check_scoring_formats(self.format, self.output_format)
        if self.task in POOLING_JOB_TASKS:
            _check_pooling_formats(self.task, self.format, self.output_format)
        if self.is_openai_batch:
            if self.template is not None:
                raise ValueError("OpenAI batch input carries its own prompts; drop --template")
            self.id_column = self.id_column or OPENAI_ID_COLUMN
            self.messages_column, self.prompt_column = "messages", "prompt"
        check_passthrough(self.passthrough, task=self.task)
        if self.id_column is not None and self.id_column in self.passthrough:
            raise ValueError(f"{self.id_column!r} is the id column; it is already the 'id' result")
        if self.is_openai_batch and self.json_schema_column is not None:
            raise ValueError(
                "OpenAI batch lines carry their own response_format; drop json_schema_column"
            )
        check_lora_option(self.lora)
        if self.lora_column is not None and not self.lora:
            raise ValueError("lora_column names adapters: register them with --lora NAME=PATH")
        if self.is_openai_batch and self.lora_column is not None:
            raise ValueError(
                "OpenAI batch lines choose their adapter by body.model; drop lora_column"
            )
        if self.output_format == "openai-batch" and not self.is_openai_batch:
            raise ValueError(
                "output_format 'openai-batch' needs OpenAI batch input (format='openai-batch')"
            )
        self.sampling  # noqa: B018 - checks how the sampling options combine
        self.template_spec  # noqa: B018 - and the prompt options
        self.llm_options  # noqa: B018 - and that engine_options repeats no option of its own

    @property
    def sampling(self) -> SamplingParams | PoolingParams:
        """The job's sampling parameters (OpenAI batch rows and a schema column may
        override some); a scoring job's are `scoring_params()`: score the prompt, sample
        nothing; a pooling job's are its PoolingParams (pipelines/pooling.py)."""
        return sampling_params(vars(self))

    @property
    def prices(self) -> Prices:
        return Prices(**routed(vars(self), PRICES))

    @property
    def template_spec(self) -> TemplateSpec:
        """How rows become prompts. OpenAI batch completion requests (a prompt, no
        messages) are sent raw, as OpenAI's completions endpoint does."""
        return TemplateSpec(
            **routed(vars(self), PROMPT),
            fallback_prompt=self.is_openai_batch,
            tools_column="tools" if self.is_openai_batch else None,
        )

    @property
    def llm_options(self) -> dict[str, Any]:
        """`LLM(...)` arguments: model, dtype, device and the engine options."""
        return llm_options(vars(self))

    @property
    def part_format(self) -> str:
        """The format of the result parts."""
        return "jsonl" if self.output_format == "jsonl" else "parquet"

    @property
    def is_openai_batch(self) -> bool:
        return self.format == "openai-batch"


def resolve_task(values: Mapping[str, Any]) -> dict[str, Any]:
    """Checked option values with their task's rules applied (`pipelines/scoring.py`).

    `raw` left unset (None) becomes the task's default: chat to generate, raw to score.
    A scoring job generates nothing, so it takes no sampling option.

    Args:
        values: every option of a surface, checked (`check_options`); `task` absent
            means generate.

    Returns:
        The values, `raw` resolved.

    Raises:
        ValueError: sampling options given to a scoring job, or a system prompt for text
            scored raw by default.
    """
    values = dict(values)
    task = values.get("task", GENERATE)
    check_pooling_options(
        values, {n: get_option(n).check(get_option(n).default) for n in POOLING_OPTIONS}
    )
    if task == SCORE or task in POOLING_JOB_TASKS:
        given = [
            option.name
            for option in OPTIONS
            if (option.to in (SAMPLING, STRUCTURED) or option.exclusive == "structured output")
            and option.name in values
            and values[option.name] != option.check(option.default)
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: a {'scoring' if task == SCORE else task} job generates "
                "nothing, so it takes no "
                "sampling or structured output options; drop them (or run task 'generate')"
            )
        if (
            task == SCORE
            and values.get("raw") is None
            and values.get("system")
            and not values.get("messages_column")
        ):
            raise ValueError(
                "a scoring job scores text as it is, and a system prompt goes through the chat "
                "template: add --chat (raw=False) to score the text as a user message after it"
            )
    if "raw" in values and values["raw"] is None:
        values["raw"] = default_raw(task)
    return values


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """The engine parameters of a job's rows, from its option values: the sampling
    options, or for a scoring job `scoring_params()` (score the prompt, sample nothing)."""
    task = values.get("task", GENERATE)
    if task == SCORE:
        return scoring_params()
    if task in POOLING_JOB_TASKS:
        return pooling_params(values)
    return generation_params(values)


def _check_scoring_formats(input_format: str | None, output_format: str) -> None:
    """Raise ValueError for the OpenAI batch formats: they hold completion requests and
    answers, and a scoring job has neither."""
    if output_format == "openai-batch":
        raise ValueError(
            "output_format 'openai-batch' is OpenAI's completion output, and a scoring job "
            "completes nothing: write its rows as parquet or jsonl"
        )
    if input_format == "openai-batch":
        raise ValueError(
            "a scoring job reads text rows (Parquet, JSONL, CSV); an OpenAI batch file holds "
            "generation requests: score their prompts from a column of a plain dataset"
        )


def _check_pooling_formats(task: str, input_format: str | None, output_format: str) -> None:
    """Raise ValueError for OpenAI batch files in a pooling job: their lines name their
    own endpoint (an embeddings line is embedded in any job that reads the file)."""
    if input_format == "openai-batch" or output_format == "openai-batch":
        raise ValueError(
            f"an OpenAI batch file's lines name their own endpoint (/v1/embeddings lines are "
            f"embedded): leave task unset for it, not {task!r}"
        )


# A row's structured outputs when it sets none of its own: the job's.
UNCHANGED: Any = object()

ConstraintCheck = Callable[[StructuredOutputs], Any]


class ParamsTable:
    """The distinct SamplingParams of a job; rows refer to them by index.

    Args:
        base: the job's own params (index 0).
        check: compiles a structured outputs constraint for the job's model, raising
            ValueError when it is invalid or cannot be enforced; called once per distinct
            params that carry one, so a bad job-level constraint fails here, before
            any compute, and a bad per-row one fails only its row.
        max_n: the most completions a row may ask for (None: no limit).
        single_reason: when set, a row asking for more than one completion is refused
            with this reason (the job cannot hold several), whatever `max_n` allows.
    """

    def __init__(
        self,
        base: SamplingParams,
        check: ConstraintCheck | None = None,
        *,
        max_n: int | None = None,
        single_reason: str | None = None,
    ) -> None:
        self.base = base
        self.params: list[SamplingParams] = []
        self._index: dict[str, int] = {}
        self._per_row = per_row_fields()
        self._check = check
        self._max_n = max_n
        self._single_reason = single_reason
        self.add(base)

    def add(self, params: SamplingParams) -> int:
        key = params_key(params)
        if key not in self._index:
            # PoolingParams (embed, classify, rerank rows) carry no constraint.
            constraint = getattr(params, "structured_outputs", None)
            if constraint is not None and self._check is not None:
                self._check(constraint)
            self._index[key] = len(self.params)
            self.params.append(params)
        return self._index[key]

    def for_row(
        self, overrides: Mapping[str, Any], *, structured: StructuredOutputs | None = UNCHANGED
    ) -> int:
        """Index of the base params with a row's non-null overrides applied.

        Args:
            overrides: per-row sampling options (OpenAI batch body fields).
            structured: the row's own constraint (None: explicitly unconstrained).

        Raises:
            ValueError: an override is invalid (e.g. temperature < 0), checked as the job
                definition checks any option, or the row's constraint cannot be compiled.
        """
        changes = {k: v for k, v in overrides.items() if k in self._per_row and v is not None}
        if not changes and structured is UNCHANGED:
            return 0
        n = changes.get("n")
        if self._max_n is not None and isinstance(n, int) and n > self._max_n:
            # Refused before anything is sized by it: n completions cost n times the work.
            raise ValueError(f"n={n} is over the limit of {self._max_n} completions (max_n)")
        if self._single_reason is not None and isinstance(n, int) and n > 1:
            raise ValueError(f"n={n}: {self._single_reason}")
        try:
            checked = {k: get_option(k).check(v) for k, v in changes.items()}
            params = replace(self.base, **routed(checked, SAMPLING))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from None
        if structured is not UNCHANGED:
            params = replace(params, structured_outputs=structured)
        return self.add(params)

    def capped(self, index: int, max_tokens: int) -> int:
        """Index of params `index` with its completion budget capped at `max_tokens`.

        Raises:
            ValueError: the params do not allow that budget (min_tokens above it).
        """
        params = self.params[index]
        if params.max_tokens <= max_tokens:
            return index
        return self.add(replace(params, max_tokens=max_tokens))
