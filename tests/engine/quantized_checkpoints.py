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


def gptq_layer(weight: IntWeight, layout: str = "v1") -> dict[str, torch.Tensor]:
    """One layer's tensors as AutoGPTQ (v1: zero points stored minus one, each field
    masked to its bits) or GPTQModel (v2) saves them: qweight, qzeros, scales, g_idx."""
    n, k = weight.shape
    half = 1 << (weight.bits - 1)
    codes = weight.q.to(torch.int16) + half  # unsigned
    zero = (
        torch.zeros(weight.scale.shape, dtype=torch.int16) if weight.zero is None else weight.zero
    )
    stored = zero.to(torch.int16) + half
    if layout == "v1":
        stored = (stored - 1) & ((1 << weight.bits) - 1)
    g_idx = weight.input_groups().to(torch.int32)
    return {
        "qweight": pack_fields(codes, weight.bits).t().contiguous(),
        "qzeros": pack_fields(stored.t(), weight.bits).contiguous(),
        "scales": weight.scale.t().contiguous(),
        "g_idx": g_idx,
    }


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_layer(weight: IntWeight) -> dict[str, torch.Tensor]:
    """One layer's tensors as AutoAWQ's GEMM layout saves them: along the outputs, word j
    field i holds output 8j + AWQ_ORDER[i]."""
    n, _ = weight.shape
    interleave = (torch.arange(0, n, 8)[:, None] + torch.tensor(AWQ_ORDER)[None, :]).reshape(-1)

    def pack(values):  # [rows, n] unsigned -> [rows, n / 8]
        return pack_fields(values[:, interleave], 4)

    zero = (
        weight.zero
        if weight.zero is not None
        else torch.zeros(weight.scale.shape, dtype=torch.int16)
    )
    return {
        "qweight": pack((weight.q.to(torch.int16) + 8).t()),
        "qzeros": pack((zero.to(torch.int16) + 8).t()),
        "scales": weight.scale.t().contiguous(),
    }


def act_order(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, seed: int = 0):
    """GPTQ's desc_act: inputs quantized in a permuted order, groups of group_size in that
    order; g_idx gives each input's group."""
    k = weight.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    permuted = quantize_int(weight[:, order], bits, group_size, symmetric)
    q = torch.empty_like(permuted.q)
    q[:, order] = permuted.q
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // permuted.group_size
    return IntWeight(q, permuted.scale, permuted.zero, permuted.group_size, bits, g_idx)


def write_quantized(
    float_dir: Path, out_dir: Path, dense_dir: Path, settings: dict, quantize, layer_tensors
) -> dict[str, IntWeight]:
    """float_dir's checkpoint with each layer `quantize(name, weight)` returns an IntWeight
    for stored as `layer_tensors(weight)` in out_dir (config.json's quantization_config
    set to `settings`), and dense_dir holding exactly the dequantized weights in fp32.

    Returns:
        Each quantized layer's IntWeight by checkpoint layer name.
    """
    tensors = load_file(float_dir / "model.safetensors")
    quantized, dense, layers = {}, {}, {}
    for name, tensor in tensors.items():
        layer = name.removesuffix(".weight")
        is_linear = name.endswith(".weight") and (
            layer.rpartition(".")[2] in PROJECTIONS or layer == "lm_head"
        )
        weight = quantize(layer, tensor) if is_linear else None
        if weight is None:
            quantized[name] = dense[name] = tensor
            continue
        for suffix, t in layer_tensors(weight).items():
            quantized[f"{layer}.{suffix}"] = t
        dense[name] = weight.dequantize()
        layers[layer] = weight
    for directory, content, config in ((out_dir, quantized, settings), (dense_dir, dense, None)):
        shutil.copytree(float_dir, directory, dirs_exist_ok=True)
        save_file(content, directory / "model.safetensors", metadata={"format": "pt"})
        raw = json.loads((directory / "config.json").read_text())
        raw.pop("quantization_config", None)
        if config is not None:
            raw["quantization_config"] = config
        if directory == dense_dir:
            raw["torch_dtype"] = "float32"
        (directory / "config.json").write_text(json.dumps(raw))
    return layers


def write_compressed_tensors(
    float_dir: Path,
    out_dir: Path,
    dense_dir: Path,
    config: dict,
    *,
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, IntWeight]:
    """float_dir's checkpoint quantized per `config`, each layer by the config group that
    takes it (a target naming it, else a matching re:, else Linear): see write_quantized."""
    groups = list(config["config_groups"].values())
    formats = {}  # id(weight) -> its group's format

    def group_for(layer):
        for rule in (
            lambda t: t == layer,
            lambda t: t.startswith("re:") and re.match(t[3:], layer),
            lambda t: t == "Linear",
        ):
            found = [g for g in groups if any(rule(t) for t in g["targets"])]
            if found:
                return found[0]
        return None

    def quantize(layer, tensor):
        group = group_for(layer)
        if group is None or not matches(layer, group["targets"], config["ignore"]):
            return None
        w = group["weights"]
        weight = quantize_int(tensor, w["num_bits"], w["group_size"], w["symmetric"])
        weight.scale = weight.scale.to(scale_dtype)
        formats[id(weight)] = group["format"]
        return weight

    return write_quantized(
        float_dir,
        out_dir,
        dense_dir,
        config,
        quantize,
        lambda weight: compressed_tensors_layer(weight, formats[id(weight)]),
    )


FP8_MAX = 448.0  # e4m3fn's largest finite value


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """Block-wise FP8 as DeepSeek's and Qwen's -FP8 checkpoints describe it: each block of
    bn outputs x bk inputs (the last ones shorter) scaled by max|w| / 448 into e4m3,
    `weight_scale_inv` that scale (the factor the codes are multiplied by). Returns an
    Fp8Weight."""
    from tokenmill.engine.quant.checkpoint.weights import Fp8Weight

    n, k = weight.shape
    bn, bk = block
    w = weight.detach().float()
    rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
    scales = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            scales[i, j] = w[(rows == i)][:, cols == j].abs().max() / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / scales[rows][:, cols]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes.view(torch.uint8), scales, block)


def fp8_block_config(block: tuple[int, int], **extra) -> dict:
    """A quantization_config as Qwen's -FP8 repositories ship it."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        **extra,
    }


def write_fp8_blocks(float_dir: Path, out_dir: Path, dense_dir: Path, block, excluded=()):
    """float_dir's checkpoint with every projection (but lm_head and the `excluded` layer
    names) block-wise FP8 in out_dir, and dense_dir holding its dequantized weights in
    fp32 (write_quantized)."""
    settings = fp8_block_config(block, **({"modules_to_not_convert": list(excluded)}))

    def quantize(layer, tensor):
        if layer == "lm_head" or layer in excluded:
            return None
        return quantize_fp8_blocks(tensor, block)

    def layer_tensors(weight):
        return {"weight": weight.codes.view(torch.float8_e4m3fn), "weight_scale_inv": weight.scales}

    return write_quantized(float_dir, out_dir, dense_dir, settings, quantize, layer_tensors)
