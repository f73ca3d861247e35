"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from tokenmill.engine.types.structured_outputs import StructuredOutputs


class _FieldDefault:
    def __repr__(self) -> str:
        return "the field's default"


# JobOption.default when a job takes the field's own default.
FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class JobOption:
    """How a batch job offers a SamplingParams field as an option of its own: the job
    definition (pipelines/options.py) takes the option's name, type, default and help
    from the field, and the rest from here."""

    default: Any = FIELD_DEFAULT  # the job's, where a batch job's differs from the field's
    per_row: bool = True  # an OpenAI batch line may set it for its own row
    everywhere: bool = True  # False: Python callers only (run_job, generate), not the CLI
    ge: float | None = None  # the values a job accepts: >= ge, > gt, <= le
    gt: float | None = None
    le: float | None = None
    metavar: str | None = None  # the command line's name for one value


def param(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Any = MISSING,
    job: JobOption | None = None,
) -> Any:
    """A field of SamplingParams: its default, its help text (the job option's help too),
    and how a job offers it (`job`; None: no job option of its own)."""
    metadata = {"help": help, "job": job}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. A request with a seed samples the same tokens whatever else shares its
    batch. n > 1 produces n completions that share the prompt's cached blocks.

    max_tokens=0 with prompt_logprobs scores the prompt and generates nothing (as
    OpenAI's completions endpoint did with echo and max_tokens 0): the request ends once
    its prompt is computed, samples no token, and may fill the whole context.

    structured_outputs constrains the output to a JSON schema, regex, choice or grammar
    (each of the n completions follows it on its own).

    Logit controls, applied in this order before temperature and the filters:
    repetition_penalty (transformers' and vLLM's definition: a token seen in the prompt or
    the output has its logit divided by the penalty when positive, multiplied when not),
    presence_penalty and frequency_penalty (OpenAI's: over generated tokens only, logit -=
    presence * (count > 0) + frequency * count), then logit_bias (token id -> added to
    its logit), then the grammar mask, then allowed_token_ids (every other token is
    masked) and bad_words (vLLM's rule: a word's last token is masked when the output
    ends with the tokens before it; a one-token word is masked always; unlike
    transformers' NoBadWordsLogitsProcessor, a word begun in the prompt is not matched).
    Logprobs are of the distribution after all of them, before temperature and the
    filters.

    How to add a sampling parameter
    -------------------------------
    Add one field with `param(default, help, job=JobOption(...))`, check its value in
    `__post_init__`, and use it in the sampler (engine/sample/). With `job=` it is also
    an option of every job surface - the CLI flag, the flow parameter, run_job's and
    generate's keyword, an OpenAI batch line's field with `per_row` - derived from this
    declaration (pipelines/options.py), plus its JobSpec field (pipelines/spec.py).
    """

    max_tokens: int = param(256, "Completion budget per row, in tokens.", job=JobOption(ge=1))
    min_tokens: int = param(
        0,
        "Tokens generated before an end-of-sequence or stop may end a completion.",
        job=JobOption(everywhere=False, ge=0),
    )
    temperature: float = param(
        1.0,
        "Sampling temperature; 0 is greedy, so reruns and resumed jobs give the same answers.",
        # A batch job is greedy unless asked: reruns and resumes reproduce its answers.
        job=JobOption(default=0.0, ge=0),
    )
    top_p: float = param(
        1.0,
        "Nucleus sampling: sample among the likeliest tokens holding this probability mass.",
        job=JobOption(gt=0, le=1),
    )
    top_k: int = param(
        0, "Sample among the k likeliest tokens; 0 disables top-k.", job=JobOption(ge=0)
    )
    min_p: float = param(
        0.0,
        "Drop tokens less likely than min_p times the likeliest one; 0 disables it.",
        job=JobOption(ge=0, le=1),
    )
    seed: int | None = param(
        None,
        "Sampling seed of every request (sampled answers then repeat across reruns).",
        job=JobOption(),
    )
    stop: list[str] = param(
        help="Stop strings: generation stops at the first one produced.",
        default_factory=list,
        job=JobOption(),
    )
    stop_token_ids: list[int] = param(
        help="Token ids that end a completion.",
        default_factory=list,
        job=JobOption(everywhere=False),
    )
    ignore_eos: bool = param(
        False,
        "Generate past end-of-sequence tokens, up to max_tokens.",
        job=JobOption(everywhere=False, per_row=False),
    )
    include_stop_str_in_output: bool = param(
        False,
        "Keep the stop string that ended a completion in its output.",
        job=JobOption(everywhere=False, per_row=False),
    )
    n: int = param(
        1,
        "Completions per row. With n > 1 the results gain a `completions` column (a list "
        "of {index, output, finish_reason, structured_output_complete}); `output` is the "
        "first.",
        job=JobOption(everywhere=False, ge=1),
    )
    # None: none; k >= 0: the sampled token's plus the top k
    logprobs: int | None = param(
        None,
        "Per generated token, its log-probability and the N likeliest tokens' (0: its own "
        "only); the results gain a `logprobs` column of {token, logprob, bytes, "
        "top_logprobs}.",
        job=JobOption(ge=0, le=20),
    )
    # None: none; k >= 0: per prompt token, its own logprob plus the top k (vLLM's shape).
    # A job sets it through its task (score), not as an option.
    prompt_logprobs: int | None = param(
        None, "Per prompt token, its log-probability and the top k alternatives'."
    )
    # A job sets it through its structured output options, one StructuredOutputs.
    structured_outputs: StructuredOutputs | None = param(
        None, "Constrain every output to a JSON schema, regex, choice or grammar."
    )
    repetition_penalty: float = param(
        1.0,
        "Penalize every token already in the prompt or the output: its logit is divided "
        "by this when positive, multiplied when negative (transformers' and vLLM's "
        "definition); 1 is off, above 1 discourages repeats.",
        job=JobOption(gt=0),
    )
    presence_penalty: float = param(
        0.0,
        "Subtract this from the logit of every token the output already holds (OpenAI's "
        "definition, in [-2, 2]); positive values push towards new tokens.",
        job=JobOption(ge=-2, le=2),
    )
    frequency_penalty: float = param(
        0.0,
        "Subtract this times its count so far from the logit of each token the output "
        "holds (OpenAI's definition, in [-2, 2]); breaks loops such as a JSON value "
        "repeated until max_tokens.",
        job=JobOption(ge=-2, le=2),
    )
    logit_bias: dict[int, float] | None = param(
        None,
        "Add a bias in [-100, 100] to these token ids' logits (-100 bans a token, 100 all "
        "but forces it): TOKEN_ID=BIAS, repeated, on the command line; a mapping in Python "
        "and flows.",
        job=JobOption(),
    )
    allowed_token_ids: list[int] | None = param(
        None, "Only these token ids may be generated.", job=JobOption(metavar="TOKEN_ID")
    )
    bad_words: list[str] = param(
        help="Words the output must not contain: the last token of a word is refused where "
        "the output ends with its other tokens (vLLM's rule).",
        default_factory=list,
        job=JobOption(metavar="WORD"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.max_tokens == 0 and (self.prompt_logprobs is None or self.n != 1):
            raise ValueError(
                "max_tokens=0 generates nothing: it scores one prompt, so it needs "
                "prompt_logprobs and n=1"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError(
                "structured_outputs must be a tokenmill.StructuredOutputs, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logit_bias is not None:
            self.logit_bias = token_bias(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must list at least one token id")
            if any(not _is_token_id(t) for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids (integers >= 0)")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty depends on the tokens seen so far."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_prompt_only(self) -> bool:
        """Scores the prompt and samples nothing (max_tokens=0)."""
        return self.max_tokens == 0


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_bias(bias) -> dict[int, float]:
    """A logit bias checked and made canonical: {token id: bias in [-100, 100]}; keys
    may be the ids' text (JSON objects have string keys).

    Raises:
        ValueError: a key that is no token id, or a bias that is no number in range.
    """
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_token_id(token):
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias[{key!r}] must be a number, got {value!r}")
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out
