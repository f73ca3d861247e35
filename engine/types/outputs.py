"""What the engine hands back: one RequestOutput per prompt, in input order."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.types.lora_request import LoRARequest


@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    # One dict per generated token: {token_id: logprob} for the sampled token and the
    # top-k alternatives; None unless SamplingParams.logprobs was set.
    logprobs: list[dict[int, float]] | None = None
    # With structured outputs: True when the text is a complete match of the schema,
    # regex, choice or grammar; False when it is not (cut by max_tokens, the context or a
    # stop string) - do not parse it then. None when the request was unconstrained.
    structured_output_complete: bool | None = None
    # A chat answer of a model whose template writes its reasoning apart (gpt-oss's
    # analysis channel, Qwen3's <think>): that reasoning, with `text` the final answer
    # (api/reasoning.py). None where the model wrote none, or the template has none.
    reasoning_content: str | None = None
    # Of its token_ids, those the split put in reasoning (api/reasoning.py); None where
    # nothing was split.
    reasoning_tokens: int | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """A finished request.

    prompt_tokens counts the prompt once; cached_tokens is how many of those were
    served from the prefix cache rather than computed; completion_tokens sums over
    all n completions. A request the engine cannot serve (prompt longer than the
    context or the whole cache) comes back with finish_reason "error" and `error` set;
    the rest of its batch is unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one
    # {token_id: logprob} per prompt token (the token itself plus the top k).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The LoRA adapter the request ran with (None: the base model).
    lora_request: LoRARequest | None = None
    # Of prompt_tokens, those that are image soft tokens (as OpenAI counts them: inside
    # the prompt's tokens, reported apart).
    image_tokens: int = 0

    # Conveniences for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def structured_output_complete(self) -> bool | None:
        return self.outputs[0].structured_output_complete


@dataclass
class EngineStats:
    """Cumulative counters since the engine was built."""

    num_requests: int = 0
    prompt_tokens: int = 0  # prompt tokens of all finished requests
    computed_prompt_tokens: int = 0  # prompt tokens that went through the model
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_errors: int = 0
    # LoRA adapters prepared into a slot - first loads and reloads after eviction (more
    # adapters in use than `max_loras` slots reload within a run).
    num_adapter_loads: int = 0
    # Structured outputs: tokens sampled under a grammar, seconds spent filling their masks
    # (overlapping the forward pass when done in the worker thread), and seconds the steps
    # were held up by masks (waiting for the fill, applying it).
    num_constrained_tokens: int = 0
    grammar_fill_s: float = 0.0
    grammar_blocking_s: float = 0.0
    # Mixture of experts, on the CPU: experts the steps ran, each MoE layer's distinct
    # experts once per step (an expert chosen by 40 rows of a step counts once: its
    # weights are read once), summed over layers and steps. 0 for dense models and off
    # the CPU, where counting would wait for each layer.
    moe_experts_used: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prompt_tokens == 0:
            return 0.0
        return self.cached_prompt_tokens / self.prompt_tokens
