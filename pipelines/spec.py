"""`JobSpec`: everything a batch job needs to know, validated before any work starts.

Defaults chosen for a batch tool: greedy decoding (temperature 0), so a rerun or a
resumed job reproduces the same answers; raw prompts unless `chat=True` or a system
prompt is given (see `templating`); results as Parquet parts under `OUTPUT/results/`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenmill.connectors.formats import normalize_format
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines.plan import DEFAULT_PLAN_WINDOW_ROWS, DEFAULT_SHARD_TOKENS
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.results import check_passthrough
from tokenmill.pipelines.templating import TemplateSpec

OUTPUT_FORMATS = ("parquet", "jsonl", "openai-batch")
OPENAI_ID_COLUMN = "custom_id"

# OpenAI batch body fields we apply per row; the rest of the sampling columns the
# connector yields (logprobs, penalties) have no equivalent here and are ignored.
PER_ROW_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
)


def default_sampling() -> SamplingParams:
    return SamplingParams(temperature=0.0)


@dataclass
class JobSpec:
    """A batch job: input, output, model, templating, sampling, prices and run options.

    Args:
        input: dataset URL or path (Parquet, JSONL, CSV, OpenAI batch; any fsspec URL).
        output: the job's output directory URL or path.
        model: model directory, .gguf file or alias; None = the default model.
        format: input format; None detects it from file names.
        prompt_column, messages_column, template, system, chat, id_column: how rows
            become prompts (see `TemplateSpec`). OpenAI batch input fixes these.
        passthrough: input columns copied into the results.
        sampling: the job's sampling parameters (OpenAI batch rows may override them).
        prices: prices for the ledger.
        shard_tokens: token budget of one shard (prompt + max completion tokens).
        plan_window_rows: input rows ordered and cut into shards together; planning
            memory grows with this, not with the dataset (see `pipelines.plan`).
        storage_options: filesystem options for input, output and ledger dataset.
        limit: only the first `limit` input rows.
        resume: skip shards already complete; False recomputes everything.
        output_format: "parquet", "jsonl", or "openai-batch" (Parquet parts plus
            `OUTPUT/results.jsonl` in OpenAI's batch output format).
        ledger_dataset: where the job's ledger row goes; None = `OUTPUT/ledger/`.
        dtype, device: how to load the model.
        engine_options: more `LLM(...)` keyword arguments (kv_cache_memory,
            max_num_seqs, max_num_batched_tokens, block_size, ...).
    """

    input: str
    output: str
    model: str | None = None
    format: str | None = None
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    template: str | None = None
    system: str | None = None
    chat: bool = False
    id_column: str | None = None
    passthrough: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=default_sampling)
    prices: Prices = field(default_factory=Prices)
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    plan_window_rows: int = DEFAULT_PLAN_WINDOW_ROWS
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    limit: int | None = None
    resume: bool = True
    output_format: str = "parquet"
    ledger_dataset: str | None = None
    dtype: str = "auto"
    device: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.input or not self.output:
            raise ValueError("input and output must be given")
        self.output = self.output.rstrip("/") or "/"
        if self.format is not None:
            self.format = normalize_format(self.format)
        if self.format == "openai-batch":
            if self.template is not None:
                raise ValueError("OpenAI batch input carries its own prompts; drop --template")
            self.id_column = self.id_column or OPENAI_ID_COLUMN
            self.messages_column, self.prompt_column = "messages", "prompt"
        self.passthrough = tuple(self.passthrough)
        check_passthrough(self.passthrough)
        if self.id_column is not None and self.id_column in self.passthrough:
            raise ValueError(f"{self.id_column!r} is the id column; it is already the 'id' result")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(
                f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {self.output_format!r}"
            )
        if self.output_format == "openai-batch" and self.format != "openai-batch":
            raise ValueError(
                "output_format 'openai-batch' needs OpenAI batch input (format='openai-batch')"
            )
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        if self.plan_window_rows < 1:
            raise ValueError(f"plan_window_rows must be >= 1, got {self.plan_window_rows}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.sampling.n != 1:
            raise ValueError("batch jobs produce one output per row; n must be 1")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError("storage_options must be a mapping")
        self.template_spec  # noqa: B018 - builds and validates the templating options

    @property
    def template_spec(self) -> TemplateSpec:
        return TemplateSpec(
            prompt_column=self.prompt_column,
            messages_column=self.messages_column,
            template=self.template,
            system=self.system,
            chat=self.chat,
            id_column=self.id_column,
            fallback_prompt=self.format == "openai-batch",
        )

    @property
    def part_format(self) -> str:
        """The format of the result parts."""
        return "jsonl" if self.output_format == "jsonl" else "parquet"

    @property
    def is_openai_batch(self) -> bool:
        return self.format == "openai-batch"


class ParamsTable:
    """The distinct SamplingParams of a job; rows refer to them by index."""

    def __init__(self, base: SamplingParams) -> None:
        self.base = base
        self.params: list[SamplingParams] = []
        self._index: dict[str, int] = {}
        self.add(base)

    def add(self, params: SamplingParams) -> int:
        key = json.dumps(asdict(params), sort_keys=True)
        if key not in self._index:
            self._index[key] = len(self.params)
            self.params.append(params)
        return self._index[key]

    def for_row(self, overrides: Mapping[str, Any]) -> int:
        """Index of the base params with a row's non-null overrides applied.

        Raises:
            ValueError: the overrides are invalid (e.g. temperature < 0) or ask for n > 1.
        """
        changes = {k: v for k, v in overrides.items() if k in PER_ROW_FIELDS and v is not None}
        if not changes:
            return 0
        if changes.get("n", 1) != 1:
            raise ValueError("n > 1 is not supported in batch jobs (one output per row)")
        changes.pop("n", None)
        try:
            params = replace(self.base, **changes)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from None
        return self.add(params)
