"""Which checkpoint tensor fills which parameter - decided from the names, shapes and dtypes
in the headers, before any weight is read.

Every tensor of a checkpoint must fill a parameter of the model. One that fills none is
refused by name: a bias the model has no place for, a quantization scale, a layer of
another architecture - loading without it would run a different model than the one
saved. The exceptions are the model's own (`checkpoint_name` returning None: a BERT
pooler that embeddings never read) and this short list, each with its reason
(`UNUSED_TENSORS`). A weight stored as integers or fp8 is quantized: read as plain
numbers without its scales it would be wrong, so it is refused too, naming its dtype
(checkpoints that say how they are quantized are refused earlier, by format:
quant/checkpoint_formats.py). The GGUF converter plans its tensors here as well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.engine.models import ModelConfig, model_class

# The dtypes a float parameter is filled from (converted as it is copied).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Prefixes of a multimodal checkpoint's vision tower and projector (transformers' names).
_VISION_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "vision_model.",
    "model.vision_model.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "visual.",
    "model.visual.",
)


def build_on_meta(config: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The architecture's model with its parameters on the meta device (no memory)."""
    with torch.device("meta"):
        return model_class(config)(config).to(dtype)


@dataclass(frozen=True)
class UnusedTensors:
    """Checkpoint tensors no parameter takes that are safe to leave, and why."""

    matches: Callable[[str, ModelConfig], bool]
    reason: str


UNUSED_TENSORS: tuple[UnusedTensors, ...] = (
    UnusedTensors(
        lambda name, config: name.endswith("rotary_emb.inv_freq"),
        "rotary inverse frequencies older transformers saved as a buffer; they are "
        "computed from the config",
    ),
    UnusedTensors(
        lambda name, config: config.tie_word_embeddings and name.startswith("lm_head."),
        "an lm_head stored beside tied embeddings: the embedding is the head, as in transformers",
    ),
    UnusedTensors(
        # A model with a vision tower of its own consumes these: one it has no place for
        # is refused like any other tensor.
        lambda name, config: (
            getattr(config, "vision", None) is None and name.startswith(_VISION_PREFIXES)
        ),
        "the vision tower and projector of a multimodal checkpoint loaded text-only",
    ),
)


@dataclass(frozen=True)
class TensorSource:
    """One checkpoint tensor as the headers describe it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    label: str | None = None  # how errors name it, if not by `name` (a GGUF's own name)

    def __str__(self) -> str:
        return self.label or self.name


@dataclass
class TensorPlan:
    """What loading will read: checkpoint name -> (parameter, shard of a fused one or None)."""

    targets: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # Checkpoint names left unread, each with why (UNUSED_TENSORS or the model's own rule).
    left: dict[str, str] = field(default_factory=dict)


def plan_tensors(
    model: nn.Module, config: ModelConfig, sources: Iterable[TensorSource], *, where: str
) -> TensorPlan:
    """Map every checkpoint tensor onto the model's parameters.

    Args:
        model: the model, built (on the meta device is enough).
        config: its config.
        sources: every tensor of the checkpoint (all its files).
        where: how errors name the checkpoint (its directory or file).
    Returns:
        The plan: what to read into which parameter.
    Raises:
        ValueError: tensors no parameter takes, a non-float weight, a shape that does
            not fit, or parameters no tensor fills - each named.
    """
    params = {name: p.shape for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # filled by tying it to the embedding
    packed = model.packed_modules
    # A model whose checkpoints name tensors its own way says how (`checkpoint_name`: an
    # encoder under "bert.", a bare decoder without "model."); None leaves a tensor.
    # Other models take a tensor saved from their bare base model (no "model." before
    # its name: a sentence-transformers decoder such as Qwen3-Embedding) under "model.".
    rename = getattr(model, "checkpoint_name", None) or functools.partial(
        _under_model, params=params, packed=packed
    )
    plan, unused, not_float = TensorPlan(), [], []
    for source in sources:
        ours = rename(source.name)
        target = None if ours is None else map_name(ours, packed)
        if target is None or target[0] not in params:
            reason = _unused_reason(source.name, config, ours is None)
            if reason is None:
                unused.append(str(source))
            else:
                plan.left[source.name] = reason
            continue
        if source.dtype not in FLOAT_DTYPES:
            not_float.append(f"{source} ({str(source.dtype).removeprefix('torch.')})")
            continue
        _check_shape(source, target, params, config)
        plan.targets[source.name] = target
    if not_float:  # first: a quantized checkpoint also holds scales no parameter takes
        raise ValueError(
            f"checkpoint in {where} stores weights as integers or fp8 - quantized, with "
            f"no quantization_config saying how to read them: {_listed(not_float)}. "
            "Load the float checkpoint (and quantize it with --quantization int8 or int4)"
        )
    if unused:
        raise ValueError(
            f"checkpoint in {where} holds tensors {config.architecture} has no place for: "
            f"{_listed(unused)}; refusing to load it without them (they would change the "
            "model)"
        )
    missing = _missing(params, plan.targets.values(), packed)
    if missing:
        raise ValueError(f"checkpoint in {where} is missing weights: {_listed(missing)}")
    return plan


def _unused_reason(name: str, config: ModelConfig, left_by_model: bool) -> str | None:
    if left_by_model:
        return "left by the model (its checkpoint_name)"
    for entry in UNUSED_TENSORS:
        if entry.matches(name, config):
            return entry.reason
    return None


def _listed(names: list[str], most: int = 8) -> str:
    more = f" (and {len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _under_model(name: str, *, params: dict, packed: dict[str, tuple[str, int]]) -> str:
    """`name`, or "model." + name when only that is a parameter."""
    if map_name(name, packed)[0] in params:
        return name
    prefixed = f"model.{name}"
    return prefixed if map_name(prefixed, packed)[0] in params else name


def map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """A checkpoint name -> (our parameter, shard index of a fused one, else None)."""
    for hf_part, (ours, shard) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard
    return name, None


def shard_sizes(target: str, config: ModelConfig) -> list[int]:
    """The rows each part of a fused projection takes: q, k, v or gate, up."""
    if "qkv_proj" in target:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _check_shape(source: TensorSource, target, params: dict, config: ModelConfig) -> None:
    name, shard = target
    want = tuple(params[name])
    if shard is not None:
        want = (shard_sizes(name, config)[shard], *want[1:])
    if tuple(source.shape) != want:
        raise ValueError(f"weight {source} has shape {tuple(source.shape)}, expected {want}")


def _missing(params: dict, filled: Iterable[tuple[str, int | None]], packed) -> list[str]:
    num_shards: dict[str, int] = {}
    for ours, shard in packed.values():
        num_shards[ours] = max(num_shards.get(ours, 0), shard + 1)
    filled = set(filled)
    missing = []
    for name in params:
        fused = next((ours for ours in num_shards if f".{ours}." in name), None)
        if fused is None:
            if (name, None) not in filled:
                missing.append(name)
            continue
        missing += [f"{name}[{i}]" for i in range(num_shards[fused]) if (name, i) not in filled]
    return missing
