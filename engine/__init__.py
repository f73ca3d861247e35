"""tokenmill's engine: the one door into it.

Everything outside the engine - the pipeline, the connectors, the flows, the CLI and the
bench harness - imports what it needs from here, `from tokenmill.engine import LLM`,
and nothing below; tests/test_layering.py checks it. The engine's internals can then
move freely. Names are loaded on first use, so `import tokenmill.engine` costs nothing
until one is asked for (the CLI starts without torch).

The engine's own folders, top to bottom (each imports only the ones below it):

    api/       LLM, its pooling methods, LLM.plan, the model description
    worker/    runs a step: model runner, KV cache formats, attention backends, build
    sample/    sampler, logit controls, prompt log-probs
    lora/      LoRA adapters: files, layers, slots
    pooling/   pooling tasks a model serves, the pooler
    quant/     one method object per quantization mode
    loader/    model resolution, conversion, weights, tokenizers
    models/    one module per architecture, shared layers
    core/      the loop: scheduler, block manager, output processor, grammar
    kernels/   C kernels (and cuda/: Triton kernels)
    types/     the public types: settings, params, outputs; env.py: TOKENMILL_* variables
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each exported name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # Running a model.
    "LLM": "tokenmill.engine.api.llm",
    "SamplingParams": "tokenmill.engine.types.sampling_params",
    "token_bias": "tokenmill.engine.types.sampling_params",
    "JobOption": "tokenmill.engine.types.sampling_params",
    "FIELD_DEFAULT": "tokenmill.engine.types.sampling_params",
    "StructuredOutputs": "tokenmill.engine.types.structured_outputs",
    "LoRARequest": "tokenmill.engine.types.lora_request",
    "PoolingParams": "tokenmill.engine.types.pooling_params",
    "POOLING_TASKS": "tokenmill.engine.types.pooling_params",
    "EMBED": "tokenmill.engine.types.pooling_params",
    "CLASSIFY": "tokenmill.engine.types.pooling_params",
    "RERANK": "tokenmill.engine.types.pooling_params",
    # What comes back.
    "RequestOutput": "tokenmill.engine.types.outputs",
    "CompletionOutput": "tokenmill.engine.types.outputs",
    "RequestMetrics": "tokenmill.engine.types.outputs",
    "EngineStats": "tokenmill.engine.types.outputs",
    "PoolingOutput": "tokenmill.engine.types.pooling_outputs",
    "EmbeddingOutput": "tokenmill.engine.types.pooling_outputs",
    "ClassificationOutput": "tokenmill.engine.types.pooling_outputs",
    "ScoringOutput": "tokenmill.engine.types.pooling_outputs",
    # Settings: declared once in EngineConfig; the choices registered beside the code.
    "EngineConfig": "tokenmill.engine.types.config",
    "engine_settings": "tokenmill.engine.types.config",
    "resolve_dtype": "tokenmill.engine.types.config",
    "setting_choices": "tokenmill.engine.worker.build",
    "check_settings": "tokenmill.engine.worker.build",
    "kv_cache_format": "tokenmill.engine.worker.kv_cache",
    # A model, described from its files (no weights loaded), found and converted.
    "ModelDescription": "tokenmill.engine.api.describe",
    "describe_model": "tokenmill.engine.api.describe",
    "ModelFilesError": "tokenmill.engine.loader.model_files",
    "resolve_model": "tokenmill.engine.loader.model_files",
    "is_hub_model": "tokenmill.engine.loader.model_files",
    "list_models": "tokenmill.engine.loader.model_files",
    "model_info": "tokenmill.engine.loader.model_files",
    "weights_hash": "tokenmill.engine.loader.model_files",
    "cache_dir": "tokenmill.engine.loader.model_files",
    "ALIASES": "tokenmill.engine.loader.aliases",
    "DEFAULT_MODEL": "tokenmill.engine.loader.aliases",
    "alias_gguf_path": "tokenmill.engine.loader.model_files",
    "convert_gguf": "tokenmill.engine.loader.gguf_convert",
    "load_config": "tokenmill.engine.models",
    "Tokenizer": "tokenmill.engine.loader.tokenizer",
    "PoolingTokenizer": "tokenmill.engine.loader.pooling_tokenizer",
    "EncodedText": "tokenmill.engine.loader.pooling_tokenizer",
    "read_pooling_config": "tokenmill.engine.pooling.config",
    "embedding_size": "tokenmill.engine.pooling.config",
    # Images: where a vision model's images sit in a prompt, and a header-only check.
    "ImageLayout": "tokenmill.engine.api.image_prompts",
    "image_layout": "tokenmill.engine.api.image_layouts",
    "ImageError": "tokenmill.engine.loader.images",
    "image_size": "tokenmill.engine.loader.images",
    "DEFAULT_MAX_IMAGE_PIXELS": "tokenmill.engine.types.config",
    "MAX_RUNNING_SEQS": "tokenmill.engine.types.config",
    # Reasoning: whether a chat answer's reasoning is written apart, and its split.
    "reasoning_format": "tokenmill.engine.api.reasoning",
    "reasons_apart_with_effort": "tokenmill.engine.api.reasoning",
    "split_reasoning_of": "tokenmill.engine.api.reasoning",
    "REASONING_EFFORTS": "tokenmill.engine.api.reasoning",
    # LoRA adapters: checked against a model, merged into its weights.
    "describe_adapter": "tokenmill.engine.lora.adapters",
    "model_names": "tokenmill.engine.lora.adapters",
    "merge_adapter": "tokenmill.engine.lora.merge",
    "lora_target_shapes": "tokenmill.engine.lora.layers",
    # Planning: LLM.plan's requests and what it returns.
    "Plan": "tokenmill.engine.api.plan",
    "PlannedRequest": "tokenmill.engine.core.simulation",
    "StepLoad": "tokenmill.engine.core.simulation",
    "MemoryPlan": "tokenmill.engine.types.memory",
    "precision_bytes": "tokenmill.engine.worker.memory",
    "InsufficientMemoryError": "tokenmill.engine.types.memory",
    # Tools: the profiling hook and what it times.
    "StepProfiler": "tokenmill.engine.types.profiling",
    "STAGES": "tokenmill.engine.types.profiling",
    "linear_kinds": "tokenmill.engine.quant",
    "weight_bytes": "tokenmill.engine.quant",
    # A checkpoint quantized by another tool, described from its config.json.
    "CheckpointInfo": "tokenmill.engine.quant",
    "checkpoint_info": "tokenmill.engine.quant",
    "onednn_linear_available": "tokenmill.engine.quant.packed_linear",
}

# What `from tokenmill.engine import *` gives, and what linters know is re-exported.
__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MAX_RUNNING_SEQS",
    "FIELD_DEFAULT",
    "ImageError",
    "ImageLayout",
    "image_layout",
    "image_size",
    "REASONING_EFFORTS",
    "reasoning_format",
    "reasons_apart_with_effort",
    "split_reasoning_of",
    "JobOption",
    "ALIASES",
    "CLASSIFY",
    "CheckpointInfo",
    "ClassificationOutput",
    "CompletionOutput",
    "DEFAULT_MODEL",
    "EMBED",
    "EmbeddingOutput",
    "EncodedText",
    "EngineConfig",
    "EngineStats",
    "InsufficientMemoryError",
    "LLM",
    "LoRARequest",
    "MemoryPlan",
    "ModelDescription",
    "ModelFilesError",
    "POOLING_TASKS",
    "Plan",
    "PlannedRequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingTokenizer",
    "RERANK",
    "RequestMetrics",
    "RequestOutput",
    "STAGES",
    "SamplingParams",
    "ScoringOutput",
    "StepLoad",
    "StepProfiler",
    "StructuredOutputs",
    "Tokenizer",
    "alias_gguf_path",
    "cache_dir",
    "check_settings",
    "checkpoint_info",
    "convert_gguf",
    "describe_adapter",
    "describe_model",
    "embedding_size",
    "engine_settings",
    "is_hub_model",
    "kv_cache_format",
    "linear_kinds",
    "list_models",
    "load_config",
    "lora_target_shapes",
    "merge_adapter",
    "model_info",
    "model_names",
    "onednn_linear_available",
    "precision_bytes",
    "read_pooling_config",
    "resolve_dtype",
    "resolve_model",
    "setting_choices",
    "token_bias",
    "weight_bytes",
    "weights_hash",
]


def __getattr__(name: str) -> Any:
    """Load an exported name on first use (module `__getattr__`, PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what a type checker and an IDE see; nothing is imported at run time
    from tokenmill.engine.api.describe import ModelDescription, describe_model
    from tokenmill.engine.api.image_layouts import image_layout
    from tokenmill.engine.api.image_prompts import ImageLayout
    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.api.plan import Plan
    from tokenmill.engine.api.reasoning import (
        REASONING_EFFORTS,
        reasoning_format,
        reasons_apart_with_effort,
        split_reasoning_of,
    )
    from tokenmill.engine.core.simulation import PlannedRequest, StepLoad
    from tokenmill.engine.loader.aliases import ALIASES, DEFAULT_MODEL
    from tokenmill.engine.loader.gguf_convert import convert_gguf
    from tokenmill.engine.loader.images import ImageError, image_size
    from tokenmill.engine.loader.model_files import (
        ModelFilesError,
        alias_gguf_path,
        cache_dir,
        is_hub_model,
        list_models,
        model_info,
        resolve_model,
        weights_hash,
    )
    from tokenmill.engine.loader.pooling_tokenizer import EncodedText, PoolingTokenizer
    from tokenmill.engine.loader.tokenizer import Tokenizer
    from tokenmill.engine.lora.adapters import describe_adapter, model_names
    from tokenmill.engine.lora.layers import lora_target_shapes
    from tokenmill.engine.lora.merge import merge_adapter
    from tokenmill.engine.models import load_config
    from tokenmill.engine.pooling.config import embedding_size, read_pooling_config
    from tokenmill.engine.quant import CheckpointInfo, checkpoint_info, linear_kinds, weight_bytes
    from tokenmill.engine.quant.packed_linear import onednn_linear_available
    from tokenmill.engine.types.config import (
        DEFAULT_MAX_IMAGE_PIXELS,
        MAX_RUNNING_SEQS,
        EngineConfig,
        engine_settings,
        resolve_dtype,
    )
    from tokenmill.engine.types.lora_request import LoRARequest
    from tokenmill.engine.types.memory import InsufficientMemoryError, MemoryPlan
    from tokenmill.engine.types.outputs import (
        CompletionOutput,
        EngineStats,
        RequestMetrics,
        RequestOutput,
    )
    from tokenmill.engine.types.pooling_outputs import (
        ClassificationOutput,
        EmbeddingOutput,
        PoolingOutput,
        ScoringOutput,
    )
    from tokenmill.engine.types.pooling_params import (
        CLASSIFY,
        EMBED,
        POOLING_TASKS,
        RERANK,
        PoolingParams,
    )
    from tokenmill.engine.types.profiling import STAGES, StepProfiler
    from tokenmill.engine.types.sampling_params import (
        FIELD_DEFAULT,
        JobOption,
        SamplingParams,
        token_bias,
    )
    from tokenmill.engine.types.structured_outputs import StructuredOutputs
    from tokenmill.engine.worker.build import check_settings, setting_choices
    from tokenmill.engine.worker.kv_cache import kv_cache_format
    from tokenmill.engine.worker.memory import precision_bytes
