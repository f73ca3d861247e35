"""Quantized checkpoints as the Hub's tools write them, built in the tests from each
format's published description (no llm-compressor needed): the quantizer, the packers,
and a writer that turns a float checkpoint into a quantized one plus the dense float
checkpoint of exactly its dequantized weights - the reference the engine must equal."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.engine.quant.checkpoint.weights import IntWeight

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_int(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
) -> IntWeight:
    """Min-max integer quantization as compressed-tensors' observers do it: signed codes
    -2^(b-1)..2^(b-1)-1; symmetric scale max|w| / ((2^b - 1) / 2), else (max - min) /
    (2^b - 1) with an integer zero point; groups of group_size inputs (the last shorter
    where it does not divide the row), or one per channel (None)."""
    n, k = weight.shape
    g = group_size or k
    num_groups = -(-k // g)
    groups = torch.arange(k) // g
    w = weight.detach().float()
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    scale = torch.empty(n, num_groups)
    zero = torch.zeros(n, num_groups, dtype=torch.int16)
    for j in range(num_groups):
        block = w[:, groups == j]
        low = block.amin(dim=1).clamp(max=0)
        high = block.amax(dim=1).clamp(min=0)
        if symmetric:
            scale[:, j] = torch.maximum(low.abs(), high) / ((hi - lo) / 2)
        else:
            scale[:, j] = (high - low) / (hi - lo)
            zero[:, j] = torch.round(lo - low / scale[:, j]).clamp(lo, hi).to(torch.int16)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-8))
    q = torch.round(w / scale[:, groups] + zero[:, groups]).clamp(lo, hi).to(torch.int8)
    return IntWeight(q, scale, None if symmetric else zero, g, bits)


def pack_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `bits`-bit values [..., count] -> int32 [..., ceil(count * bits / 32)]:
    element i of a row at bits i * bits.. of the row's little-endian bytes, as
    compressed-tensors' pack_to_int32 stores them (the last word's spare fields zero)."""
    per_word = 32 // bits
    count = fields.shape[-1]
    words = -(-count // per_word)
    padded = torch.zeros((*fields.shape[:-1], words * per_word), dtype=torch.int64)
    padded[..., :count] = fields.to(torch.int64)
    shifts = torch.arange(per_word) * bits
    packed = (padded.view(*fields.shape[:-1], words, per_word) << shifts).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def compressed_tensors_layer(weight: IntWeight, fmt: str) -> dict[str, torch.Tensor]:
    """One layer's tensors as compressed-tensors saves them in `fmt` (suffix -> tensor)."""
    n, k = weight.shape
    half = 1 << (weight.bits - 1)
    tensors = {"weight_scale": weight.scale}
    if fmt == "pack-quantized":
        tensors["weight_packed"] = pack_fields(weight.q.to(torch.int16) + half, weight.bits)
        tensors["weight_shape"] = torch.tensor([n, k])
        if weight.zero is not None:  # packed along the output channels
            zero = pack_fields(weight.zero.t().to(torch.int16) + half, weight.bits)
            tensors["weight_zero_point"] = zero.t()
    else:
        tensors["weight"] = weight.q.to(torch.int8)
        if weight.zero is not None:
            tensors["weight_zero_point"] = weight.zero.to(torch.int8)
    if weight.g_idx is not None:
        tensors["weight_g_idx"] = weight.g_idx.to(torch.int32)
    return {name: t.contiguous() for name, t in tensors.items()}


def ct_config(
    fmt: str,
    bits: int,
    group_size: int | None,
    symmetric: bool = True,
    *,
    activations: bool = False,
    ignore: tuple[str, ...] = ("lm_head",),
    targets: tuple[str, ...] = ("Linear",),
) -> dict:
    """A quantization_config as llm-compressor writes it for one scheme."""
    strategy = "group" if group_size else "channel"
    token = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": {
                    "num_bits": bits,
                    "type": "int",
                    "symmetric": symmetric,
                    "strategy": strategy,
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": {**token, "symmetric": True} if activations else None,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "version": "0.20.1",
    }


def matches(name: str, targets, ignore) -> bool:
    """compressed-tensors' rule for a Linear layer: a target (Linear, a name or re:) and no ignore."""

    def hit(rules):
        return any(
            r in ("Linear", name) or (r.startswith("re:") and re.match(r[3:], name)) for r in rules
        )

    return hit(targets) and not hit(ignore)


def write_compressed_tensors(
    float_dir: Path,
    out_dir: Path,
    dense_dir: Path,
    config: dict,
    *,
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, IntWeight]:
    """float_dir's checkpoint quantized per `config` (one config group) into out_dir, and
    dense_dir holding exactly the dequantized weights in fp32 (the reference).

    Returns:
        Each quantized layer's IntWeight by checkpoint layer name.
    """
    group = config["config_groups"]["group_0"]
    fmt, w = group["format"], group["weights"]
    tensors = load_file(float_dir / "model.safetensors")
    quantized, dense, layers = {}, {}, {}
    for name, tensor in tensors.items():
        layer = name.removesuffix(".weight")
        is_linear = name.endswith(".weight") and (
            layer.rpartition(".")[2] in PROJECTIONS or layer == "lm_head"
        )
        if not is_linear or not matches(layer, group["targets"], config["ignore"]):
            quantized[name] = dense[name] = tensor
            continue
        weight = quantize_int(tensor, w["num_bits"], w["group_size"], w["symmetric"])
        weight.scale = weight.scale.to(scale_dtype)
        for suffix, t in compressed_tensors_layer(weight, fmt).items():
            quantized[f"{layer}.{suffix}"] = t
        dense[name] = weight.dequantize()
        layers[layer] = weight
    for directory, content, settings in ((out_dir, quantized, config), (dense_dir, dense, None)):
        shutil.copytree(float_dir, directory, dirs_exist_ok=True)
        save_file(content, directory / "model.safetensors", metadata={"format": "pt"})
        raw = json.loads((directory / "config.json").read_text())
        raw.pop("quantization_config", None)
        if settings is not None:
            raw["quantization_config"] = settings
        if directory == dense_dir:
            raw["torch_dtype"] = "float32"
        (directory / "config.json").write_text(json.dumps(raw))
    return layers
