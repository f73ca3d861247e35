"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.types.structured_outputs import StructuredOutputs


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
    ends with the tokens before it; a one-token word is masked always). Logprobs are of
    the distribution after all of them, before temperature and the filters.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's plus the top k
    # None: none; k >= 0: per prompt token, its own logprob plus the top k (vLLM's shape)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages repeating
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: any)
    bad_words: list[str] = field(default_factory=list)

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
