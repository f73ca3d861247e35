"""`LLM.plan`: what the engine will do with a job's requests, before it computes any.

The engine that will run them is sized as it sizes itself - a loaded LLM's own, or, on
the class, the one its settings would build for a model, from the model's files alone
(`worker/build.py`'s sizing: no weights are read). Over that engine, the plan:

- says how each request will be treated (a pooling request knows whether its pooling
  reads every prompt row, so whether the prefix cache may serve it);
- replays the prefix cache over the requests in order (`core/simulation.py`,
  `replay_prefix_cache`): each request's cached tokens, exact whenever the cache never
  has to evict (`cached_tokens_exact`), an upper bound otherwise;
- with `simulate=True`, runs the engine's own loop (`LLMEngine` or `EncoderEngine`,
  their scheduler and block manager) over a stand-in model that ends each completion
  after the request's scripted `completion_tokens`: the steps it takes and the cached
  tokens it bills, eviction and preemption included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.core.encoder_engine import EncoderEngine
from tokenmill.engine.core.simulation import (
    PlannedRequest,
    Simulation,
    never_evicts,
    replay_prefix_cache,
    simulate_encoder,
    simulate_engine,
)
from tokenmill.engine.loader.model_files import resolve_model
from tokenmill.engine.models import architecture_for, load_config
from tokenmill.engine.pooling.config import PoolingConfig, read_pooling_config
from tokenmill.engine.pooling.pooler import reads_every_token
from tokenmill.engine.quant.checkpoint_formats import check_checkpoint_quantization
from tokenmill.engine.types.config import EngineConfig, engine_settings, resolve_dtype
from tokenmill.engine.types.memory import MemoryPlan
from tokenmill.engine.worker.build import max_model_len_of, plan_memory


@dataclass(frozen=True)
class EngineShape:
    """What planning must know of the engine that will run the requests."""

    config: EngineConfig
    num_blocks: int  # KV cache blocks: the prefix cache's capacity (an encoder: none)
    max_model_len: int
    vocab_size: int
    device: str
    # An encoder runs its own loop (`EncoderEngine`): no KV cache, nothing cached.
    is_encoder: bool = False
    # How a pooling model pools, and the token its head reads: whether a decoder's
    # pooling request may be served from the prefix cache (`reads_every_token`).
    pooling_config: PoolingConfig | None = None
    head_pooling: str | None = None
    # Its weights and KV cache against the RAM left (None: a stand-in engine).
    memory: MemoryPlan | None = None

    def treat(self, request: PlannedRequest) -> PlannedRequest:
        """`request` as this engine treats it: a pooling one knows whether its pooling
        reads every row."""
        if not request.is_pooling or self.pooling_config is None:
            return request
        every = reads_every_token(self.pooling_config, self.head_pooling, request.params)
        return replace(request, reads_every_token=every)


@dataclass
class Plan:
    """What `LLM.plan` found (see the module docstring)."""

    shape: EngineShape
    batches: list[list[PlannedRequest]]  # as given, each request as the engine treats it
    cached_tokens: list[int]  # per request, all batches in order: the replay's figure
    cached_tokens_exact: bool  # the replay is what the engine will bill
    simulation: Simulation | None = None  # with simulate=True

    @property
    def requests(self) -> list[PlannedRequest]:
        return [r for batch in self.batches for r in batch]

    @property
    def block_size(self) -> int:
        return self.shape.config.block_size


def plan_requests(
    llm: Any,
    batches: Sequence[Sequence[PlannedRequest]],
    *,
    simulate: bool = False,
    model: str | Path | None = None,
    revision: str | None = None,
    **settings: Any,
) -> Plan:
    """`LLM.plan`: on a loaded `llm`, its own engine; with llm None, the engine
    `LLM(model, revision=revision, **settings)` would build (see the module docstring).

    Args:
        batches: the requests of each call (`generate` or `encode`), in run order; a
            job's: its shards' rows.
        simulate: also run the engine's loop with each request's `completion_tokens`.

    Raises:
        TypeError: settings given with a loaded LLM, or a keyword that is not a setting.
    """
    if llm is not None:
        if settings or model is not None or revision is not None:
            raise TypeError("a loaded LLM plans with its own model and settings")
        shape = shape_of(llm)
    else:
        shape = shape_for(model, revision=revision, **settings)
    treated = [[shape.treat(r) for r in batch] for batch in batches]
    requests = [r for batch in treated for r in batch]
    if shape.is_encoder:  # no KV cache: nothing is ever served from a cache
        cached, exact = [0] * len(requests), True
    else:
        cached = replay_prefix_cache(requests, shape.config.block_size)
        exact = never_evicts(requests, shape.config.block_size, shape.num_blocks)
    result = Plan(shape, treated, cached, exact)
    if simulate:
        result.simulation = _simulate(treated, shape)
    return result


def shape_of(llm: Any) -> EngineShape:
    """The shape of a loaded LLM's engine."""
    is_encoder = isinstance(llm.engine, EncoderEngine)
    pooler = getattr(getattr(llm.engine, "runner", None), "pooler", None)
    return EngineShape(
        llm.engine_config,
        0 if is_encoder else llm.engine.block_manager.num_blocks,
        llm.max_model_len,
        llm.model_config.vocab_size,
        str(llm.device),
        is_encoder=is_encoder,
        pooling_config=llm.pooling_config if pooler is not None else None,
        head_pooling=pooler.head_pooling if pooler is not None else None,
        memory=llm.memory,
    )


def shape_for(
    model: str | Path | None, *, revision: str | None = None, **settings: Any
) -> EngineShape:
    """The shape of the engine `LLM(model, **settings)` would build, from the model's
    files: sized as the engine sizes itself, without loading anything. On CUDA it is
    sized from the memory free now, before the weights take their share: its capacity is
    then an upper bound."""
    unknown = sorted(set(settings) - {f.name for f in engine_settings()})
    if unknown:
        raise TypeError(f"LLM.plan() got unknown engine settings {', '.join(unknown)}")
    config = EngineConfig(**settings)
    model_dir = resolve_model(model, revision=revision)
    model_config = load_config(model_dir)
    architecture = architecture_for(model_config)
    pooling = read_pooling_config(model_dir, is_encoder=architecture.is_encoder)
    head_pooling = getattr(architecture.model_class, "head_pooling", None)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(config.dtype, device)
    # Planned as the load plans it; a model this machine cannot hold is refused here too.
    quantized = check_checkpoint_quantization(model_dir) is not None
    memory = plan_memory(
        model_config,
        config,
        dtype=dtype,
        device=device,
        encoder=architecture.is_encoder,
        model_dir=model_dir,
        quantized_checkpoint=model_dir if quantized else None,
    )
    memory.check(model_dir.name)
    if architecture.is_encoder:
        return EngineShape(
            config,
            0,
            max_model_len_of(model_config, config, pooling.max_seq_length),
            model_config.vocab_size,
            str(device),
            is_encoder=True,
            pooling_config=pooling,
            head_pooling=head_pooling,
            memory=memory,
        )
    return EngineShape(
        config,
        memory.kv_cache_blocks,
        max_model_len_of(model_config, config),
        model_config.vocab_size,
        str(device),
        pooling_config=pooling,
        head_pooling=head_pooling,
        memory=memory,
    )


def _simulate(batches: list[list[PlannedRequest]], shape: EngineShape) -> Simulation:
    if shape.is_encoder:
        return simulate_encoder(
            batches, shape.config, max_model_len=shape.max_model_len, vocab_size=shape.vocab_size
        )
    return simulate_engine(
        batches,
        shape.config,
        num_blocks=shape.num_blocks,
        max_model_len=shape.max_model_len,
        vocab_size=shape.vocab_size,
    )


class loaded_or_not:  # lower-case: a decorator, like classmethod
    """A method that works on a loaded instance and on the class alike: the function
    receives the instance, or None when called on the class (`LLM.plan`)."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        return functools.partial(self.func, instance)
