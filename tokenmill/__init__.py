"""tokenmill: batch/offline LLM inference - datasets in, answers and a token-cost ledger out.

The public API is imported lazily so `import tokenmill` (and the CLI's start-up) stays
cheap until a piece is actually used; the engine's part comes through its front door,
`tokenmill.engine`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tokenmill.version import __version__

_EXPORTS = {
    "LLM": "tokenmill.engine",
    "SamplingParams": "tokenmill.engine",
    "LoRARequest": "tokenmill.engine",
    "StructuredOutputs": "tokenmill.engine",
    "RequestOutput": "tokenmill.engine",
    "CompletionOutput": "tokenmill.engine",
    "generate": "tokenmill.pipelines.notebook",
    "forecast": "tokenmill.pipelines.notebook",
    "Forecast": "tokenmill.pipelines.forecast",
    "score": "tokenmill.pipelines.notebook",
    "embed": "tokenmill.pipelines.notebook",
    "classify": "tokenmill.pipelines.notebook",
    "rerank": "tokenmill.pipelines.notebook",
    "PoolingParams": "tokenmill.engine",
    "EmbeddingOutput": "tokenmill.engine",
    "ClassificationOutput": "tokenmill.engine",
    "ScoringOutput": "tokenmill.engine",
    "run_job": "tokenmill.pipelines.job",
    "JobLedger": "tokenmill.pipelines.ledger",
}

__all__ = [
    "LLM",
    "ClassificationOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "Forecast",
    "JobLedger",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "StructuredOutputs",
    "__version__",
    "classify",
    "embed",
    "forecast",
    "generate",
    "rerank",
    "run_job",
    "score",
]

if TYPE_CHECKING:
    from tokenmill.engine import (
        LLM,
        ClassificationOutput,
        CompletionOutput,
        EmbeddingOutput,
        LoRARequest,
        PoolingParams,
        RequestOutput,
        SamplingParams,
        ScoringOutput,
        StructuredOutputs,
    )
    from tokenmill.pipelines.forecast import Forecast
    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.ledger import JobLedger
    from tokenmill.pipelines.notebook import classify, embed, forecast, generate, rerank, score


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(import_module(module), name)
