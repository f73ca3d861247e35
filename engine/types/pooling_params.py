"""Per-request pooling parameters: what a prompt-only request makes of its hidden states.

A pooling request computes its prompt and samples nothing. What comes back depends on
its task:

    embed     one vector: the model's pooling (mean, CLS, last token, ...) over the final
              hidden states, normalised when the model says so (sentence-transformers'
              Normalize module); `dimensions` keeps the first n values (Matryoshka
              models) and normalises again.
    classify  the sequence-classification head's probabilities over its labels
              (softmax; sigmoid for a single-label or multi-label head).
    rerank    one relevance score of a (query, document) pair: the head's logit
              through the model's activation (sentence-transformers' CrossEncoder
              default: sigmoid for a one-label head).
"""

from __future__ import annotations

from dataclasses import dataclass

EMBED, CLASSIFY, RERANK = "embed", "classify", "rerank"
POOLING_TASKS = (EMBED, CLASSIFY, RERANK)


@dataclass(frozen=True)
class PoolingParams:
    """How one pooling request's output is made.

    Args:
        task: embed, classify or rerank.
        dimensions: embed only - keep the first n values of the embedding and normalise
            it again (Matryoshka truncation); None keeps every value.
        normalize: embed only - unit-normalise the embedding; None does what the model's
            sentence-transformers modules say (a Normalize module, or none).
    """

    task: str = EMBED
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; choose from {POOLING_TASKS}")
        if self.dimensions is not None:
            if self.task != EMBED:
                raise ValueError("dimensions applies to embeddings only")
            if isinstance(self.dimensions, bool) or self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.normalize is not None and self.task != EMBED:
            raise ValueError("normalize applies to embeddings only")

    # A pooling request generates nothing: what a job plan counts per row besides its
    # prompt (`pipelines/plan.row_cost`), and the one completion it ends with.
    max_tokens = 0
    n = 1
