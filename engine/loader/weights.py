"""Build a model on the meta device and fill it from safetensors files (never pickle),
one tensor at a time."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.loader.model_files import weight_files
from tokenmill.engine.loader.safetensors_files import iter_tensors, read_header
from tokenmill.engine.models import ModelConfig, model_class


def load_model(
    model_dir: Path, config: ModelConfig, *, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Instantiate the architecture and load every parameter from the checkpoint.

    Raises:
        ValueError: a parameter is missing from the checkpoint or has the wrong shape.
    """
    # Built on the meta device and cast there, then given memory of the final dtype once:
    # nothing is initialised or allocated twice (every parameter is loaded below).
    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    _materialize(model, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed = model.packed_modules
    # A model whose checkpoints name tensors its own way says how (`checkpoint_name`: an
    # encoder under "bert.", a bare decoder without "model."); None skips a tensor. Other
    # models take a tensor saved from their bare base model (no "model." before its
    # name: a sentence-transformers decoder such as Qwen3-Embedding) under "model.".
    rename = getattr(model, "checkpoint_name", None) or functools.partial(
        _under_model, params=params, packed=packed
    )

    for path in weight_files(model_dir):
        wanted = set()
        for entry in read_header(path):
            if entry.name.startswith("lm_head.") and config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            ours = rename(entry.name)
            if ours is not None and _map_name(ours, packed)[0] in params:
                wanted.add(entry.name)  # not e.g. rotary inv_freq buffers of old checkpoints
        for name, tensor in iter_tensors(path, wanted):
            name = rename(name)
            target, shard = _map_name(name, packed)
            param = params[target]
            if shard is None:
                _copy_checked(param.data, tensor, name)
            else:
                _copy_shard(param.data, tensor, shard, target, config)
            loaded.add(target if shard is None else f"{target}#{shard}")

    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = _missing(params, loaded, packed)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing weights: {', '.join(missing[:8])}")
    return model.eval()


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialised memory on `device`.

    What `Module.to_empty` does, without its first call's cost: it routes through the meta
    dispatcher, which imports torch's symbolic-shape machinery (a third of a second).
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def _under_model(name: str, *, params: dict, packed: dict[str, tuple[str, int]]) -> str:
    """`name`, or "model." + name when only that is a parameter."""
    if _map_name(name, packed)[0] in params:
        return name
    prefixed = f"model.{name}"
    return prefixed if _map_name(prefixed, packed)[0] in params else name


def _map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    for hf_part, (ours, shard) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard
    return name, None


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _shard_sizes(target: str, config: ModelConfig) -> list[int]:
    if "qkv_proj" in target:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _copy_shard(dst: torch.Tensor, src: torch.Tensor, shard: int, target: str, config) -> None:
    sizes = _shard_sizes(target, config)
    offset = sum(sizes[:shard])
    _copy_checked(dst.narrow(0, offset, sizes[shard]), src, f"{target}[{shard}]")


def _missing(params: dict, loaded: set[str], packed: dict[str, tuple[str, int]]) -> list[str]:
    num_shards = {}
    for ours, shard in packed.values():
        num_shards[ours] = max(num_shards.get(ours, 0), shard + 1)
    missing = []
    for name in params:
        fused = next((ours for ours in num_shards if f".{ours}." in name), None)
        if fused is None:
            if name not in loaded:
                missing.append(name)
            continue
        missing += [f"{name}[{i}]" for i in range(num_shards[fused]) if f"{name}#{i}" not in loaded]
    return missing
