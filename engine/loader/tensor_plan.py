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
import re
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


# A mixture-of-experts layer keeps its experts' weights stacked, one parameter per
# projection ([num_experts, out, in], models/moe.py); checkpoints store one tensor per
# expert (`...experts.3.gate_proj.weight`, after the packed rename `...experts.3.
# gate_up_proj.weight`), one stack per projection (`...experts.gate_proj.weight`: a GGUF's
# ffn_gate_exps), or the whole stack under the parameter's own name.
_EXPERT_TENSOR = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
_EXPERT_STACK = re.compile(r"(.*\.experts)\.(\w+)\.weight")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, or a part of one - a shard of a
    fused projection (its rows), one expert of a stacked one, or both."""

    param: str
    shard: int | None = None
    expert: int | None = None


@dataclass
class TensorPlan:
    """What loading will read: checkpoint name -> its Target."""

    targets: dict[str, Target] = field(default_factory=dict)
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
    # A parameter stored as bytes (gpt-oss's MXFP4 experts) takes the checkpoint's bytes.
    byte_params = {name for name, p in model.named_parameters() if p.dtype == torch.uint8}
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
        target = None if ours is None else target_of(ours, packed)
        if target is None or target.param not in params:
            reason = _unused_reason(source.name, config, ours is None)
            if reason is None:
                unused.append(str(source))
            else:
                plan.left[source.name] = reason
            continue
        if source.dtype not in FLOAT_DTYPES and not (
            source.dtype == torch.uint8 and target.param in byte_params
        ):
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
    if target_of(name, packed).param in params:
        return name
    prefixed = f"model.{name}"
    return prefixed if target_of(prefixed, packed).param in params else name


def target_of(name: str, packed: dict[str, tuple[str, int]]) -> Target:
    """A checkpoint name -> its Target: the fused projection and shard it fills
    (`map_name`), and the expert, where it is one expert's tensor of a stacked parameter."""
    ours, shard = map_name(name, packed)
    expert = _EXPERT_TENSOR.fullmatch(ours)
    if expert is not None:
        return Target(f"{expert[1]}.{expert[3]}", shard, int(expert[2]))
    stack = _EXPERT_STACK.fullmatch(ours)
    if stack is not None:
        return Target(f"{stack[1]}.{stack[2]}", shard)
    return Target(ours, shard)


def map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """A checkpoint name -> (our parameter, shard index of a fused one, else None)."""
    for hf_part, (ours, shard) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard
    return name, None


def shard_sizes(target: str, config: ModelConfig, rows: int | None = None) -> list[int]:
    """The rows each part of a fused projection takes: q, k, v or gate, up - halves of
    `rows` where given (an expert's gate_up is its own intermediate size), else the
    config's intermediate size."""
    if "qkv_proj" in target:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    half = config.intermediate_size if rows is None else rows // 2
    return [half, half]


def target_shape(target: Target, param_shape: tuple[int, ...], config: ModelConfig) -> tuple:
    """The shape of the checkpoint tensor that fills `target` of a parameter this shape."""
    want = tuple(param_shape)
    if target.expert is not None:
        want = want[1:]
    if target.shard is not None:
        dim = shard_dim(target)
        rows = shard_sizes(target.param, config, want[dim])[target.shard]
        want = (*want[:dim], rows, *want[dim + 1 :])
    return want


def shard_dim(target: Target) -> int:
    """The dimension a shard of `target`'s parameter splits: the rows, after the experts
    of a stack filled whole."""
    return 1 if target.expert is None and is_stacked(target.param) else 0


def _check_shape(source: TensorSource, target: Target, params: dict, config: ModelConfig) -> None:
    want = target_shape(target, params[target.param], config)
    if target.expert is not None and target.expert >= params[target.param][0]:
        raise ValueError(f"weight {source} is expert {target.expert} of {params[target.param][0]}")
    if tuple(source.shape) != want:
        raise ValueError(f"weight {source} has shape {tuple(source.shape)}, expected {want}")


def _missing(params: dict, filled: Iterable[Target], packed) -> list[str]:
    """Parameters (or their parts) no tensor fills: a stacked expert parameter is filled by
    its whole stack or by every expert's tensor (each shard of a fused one)."""
    num_shards: dict[str, int] = {}
    for ours, shard in packed.values():
        num_shards[ours] = max(num_shards.get(ours, 0), shard + 1)
    filled = set(filled)
    whole = {(t.param, t.shard) for t in filled if t.expert is None}
    missing = []
    for name, shape in params.items():
        fused = next(
            (ours for ours in num_shards if f".{ours}." in name or name.endswith(f".{ours}")), None
        )
        shards = [None] if fused is None or (name, None) in whole else range(num_shards[fused])
        experts = range(shape[0]) if is_stacked(name) else [None]
        for shard in shards:
            if (name, shard) in whole:
                continue
            for expert in experts:
                if Target(name, shard, expert) not in filled:
                    part = "" if shard is None else f"[{shard}]"
                    missing.append(
                        name + part if expert is None else f"{name}{part} of expert {expert}"
                    )
    return missing


def is_stacked(param: str) -> bool:
    """Whether a parameter stacks its layer's experts (models/moe.py names them so)."""
    return ".experts." in param and not param.endswith(".weight")
