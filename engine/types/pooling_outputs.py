"""What a pooling request hands back: one output per prompt, in input order.

`PoolingOutput` is the engine's record of a finished pooling request (the pipelines read
it: tokens, timings, the vector as a tensor). `LLM.embed`, `LLM.classify` and `LLM.score`
return its task's view - `EmbeddingOutput.embedding`, `ClassificationOutput.probs` and
`.label`, `ScoringOutput.score` - as vLLM's offline API names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tokenmill.engine.types.outputs import RequestMetrics


@dataclass
class PoolingOutput:
    """A finished pooling request.

    `data` is float32 on the CPU: [dimensions] for an embedding, [num_labels] for
    classification probabilities, [1] for a rerank score; None for a request the engine
    could not serve (`error` says why; nothing of it was computed or billed).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    task: str
    data: torch.Tensor | None
    prompt_tokens: int
    cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    # The text was cut to the model's max_seq_length before it was computed (as
    # sentence-transformers does by default); only texts given to LLM set it.
    truncated: bool = False
    # The classification head's label names (config.json's id2label), in logit order.
    label_names: tuple[str, ...] = field(default=(), repr=False)

    # Nothing is generated: the ledger's completion tokens for the request.
    completion_tokens = 0

    @property
    def finish_reason(self) -> str:
        """The task's name, or "error"."""
        return "error" if self.error is not None else self.task


def _values(output: PoolingOutput) -> list[float]:
    if output.data is None:
        raise ValueError(f"request {output.request_id} failed: {output.error}")
    return output.data.tolist()


@dataclass
class EmbeddingOutput(PoolingOutput):
    @property
    def embedding(self) -> list[float]:
        """The embedding (raises ValueError for a failed request)."""
        return _values(self)


@dataclass
class ClassificationOutput(PoolingOutput):
    @property
    def probs(self) -> list[float]:
        """One probability per label, in the head's order (`label_names`)."""
        return _values(self)

    @property
    def label(self) -> str:
        """The likeliest label's name (its index as text when the model names none)."""
        probs = self.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        return self.label_names[best] if best < len(self.label_names) else str(best)


@dataclass
class ScoringOutput(PoolingOutput):
    @property
    def score(self) -> float:
        """The pair's relevance score."""
        return _values(self)[0]


_VIEWS = {"embed": EmbeddingOutput, "classify": ClassificationOutput, "rerank": ScoringOutput}


def task_view(output: PoolingOutput) -> PoolingOutput:
    """`output` as its task's output type (same fields)."""
    cls = _VIEWS[output.task]
    return cls(**{f.name: getattr(output, f.name) for f in fields(PoolingOutput)})
