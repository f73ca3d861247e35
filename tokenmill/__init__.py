"""tokenmill: batch/offline LLM inference - datasets in, answers and a token-cost ledger out.

The public API is imported lazily so `import tokenmill` (and the CLI's start-up) stays
cheap until a piece is actually used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tokenmill.version import __version__

_EXPORTS = {
    "LLM": "tokenmill.engine.api.llm",
    "SamplingParams": "tokenmill.engine.types.sampling_params",
    "LoRARequest": "tokenmill.engine.types.lora_request",
    "StructuredOutputs": "tokenmill.engine.types.structured_outputs",
    "RequestOutput": "tokenmill.engine.types.outputs",
    "CompletionOutput": "tokenmill.engine.types.outputs",
    "generate": "tokenmill.pipelines.notebook",
    "forecast": "tokenmill.pipelines.notebook",
    "Forecast": "tokenmill.pipelines.forecast",
    "score": "tokenmill.pipelines.notebook",
    "embed": "tokenmill.pipelines.notebook",
    "classify": "tokenmill.pipelines.notebook",
    "rerank": "tokenmill.pipelines.notebook",
    "PoolingParams": "tokenmill.engine.types.pooling_params",
    "EmbeddingOutput": "tokenmill.engine.types.pooling_outputs",
    "ClassificationOutput": "tokenmill.engine.types.pooling_outputs",
    "ScoringOutput": "tokenmill.engine.types.pooling_outputs",
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
    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.types.lora_request import LoRARequest
    from tokenmill.engine.types.outputs import CompletionOutput, RequestOutput
    from tokenmill.engine.types.pooling_outputs import (
        ClassificationOutput,
        EmbeddingOutput,
        ScoringOutput,
    )
    from tokenmill.engine.types.pooling_params import PoolingParams
    from tokenmill.engine.types.sampling_params import SamplingParams
    from tokenmill.engine.types.structured_outputs import StructuredOutputs
    from tokenmill.pipelines.forecast import Forecast
    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.ledger import JobLedger
    from tokenmill.pipelines.notebook import classify, embed, forecast, generate, rerank, score


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(import_module(module), name)
