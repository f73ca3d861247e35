"""compressed-tensors checkpoints (what llm-compressor writes): `pack-quantized` integer
weights (W4A16, W8A16), `int-quantized` and `naive-quantized` int8 weights, with dynamic
per-token int8 activations (W8A8) or none, and `float-quantized` FP8 (e4m3) weights per
channel, per tensor or in 2-D blocks, with dynamic per-token FP8 activations
(FP8_DYNAMIC) or none.

The config: `config_groups` each give a scheme (weights, input_activations) and its
`targets` (the class "Linear", layer names, or "re:" regular expressions matched from
the start of the name); `ignore` lists layers left in float, by the same rules; `format`
is the storage, per group or for all. A layer named exactly by a target takes that
group, else one whose regular expression matches, else one targeting "Linear".

The tensors of a layer, as compressed-tensors' compressors save them:
- pack-quantized: `weight_packed` int32 [n, ceil(k * bits / 32)], the codes q + 2^(bits-1)
  from the lowest bits of each word up; `weight_shape` [2] = (n, k); `weight_scale`
  [n, groups]; asymmetric: `weight_zero_point` packed the same way along the output
  channels, int32 [ceil(n * bits / 32), groups]; activation order: `weight_g_idx` [k].
- int-quantized / naive-quantized: `weight` int8 [n, k] (the codes), `weight_scale`
  [n, groups], asymmetric: `weight_zero_point` int8 [n, groups].
- float-quantized (and naive-quantized with float weights, as FP8 weights without FP8
  activations are saved): `weight` float8_e4m3fn [n, k], `weight_scale` [n, 1] per channel, [1]
  per tensor, or [ceil(n / bn), ceil(k / bk)] for strategy block (block_structure
  [bn, bk]); no zero points (FP8 is symmetric).
A value is (q - zero) * scale, groups of `group_size` inputs in order (the last one
shorter where the size does not divide k), one per channel, or one for the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tokenmill.engine.quant.checkpoint.format import (
    SCALE_DTYPES,
    CheckpointFormat,
    FormatReader,
    TensorSpec,
    register_format,
    unpack_int32,
)
from tokenmill.engine.quant.checkpoint.fp8 import fp8_weight
from tokenmill.engine.quant.checkpoint.weights import IntWeight, LayerScheme

PACKED = "pack-quantized"
INT = "int-quantized"
NAIVE = "naive-quantized"
FLOAT = "float-quantized"
FORMATS = (PACKED, INT, NAIVE, FLOAT)
# Formats that are compressed-tensors' but not read here, each with the nearest that is.
_REFUSED_FORMATS = {
    "nvfp4-pack-quantized": "4-bit float weights are not read; a W4A16 (pack-quantized) one is",
    "mxfp4-pack-quantized": "4-bit float weights are not read; a W4A16 (pack-quantized) one is",
    "marlin-24": "2:4 sparse weights are not read; a dense W4A16 checkpoint is",
    "sparse-24-bitmask": "2:4 sparse weights are not read; a dense checkpoint is",
    "sparse-bitmask": "sparse weights are not read; a dense checkpoint is",
}
_NEAREST = "a W4A16 (pack-quantized) or W8A8 (int-quantized, dynamic per-token) checkpoint"


@dataclass(frozen=True)
class _Group:
    """One config group: its scheme and the layers it targets."""

    name: str
    scheme: LayerScheme
    names: frozenset[str]  # exact layer names
    patterns: tuple[re.Pattern, ...]
    all_linear: bool


class CompressedTensorsReader(FormatReader):
    def __init__(self, groups: list[_Group], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore_names = frozenset(i for i in ignore if not i.startswith("re:"))
        self.ignore_patterns = tuple(re.compile(i[3:]) for i in ignore if i.startswith("re:"))

    def all_schemes(self) -> list[LayerScheme]:
        return [g.scheme for g in self.groups]

    def scheme(self, module: str) -> LayerScheme | None:
        if module in self.ignore_names or "Linear" in self.ignore_names:
            return None
        if any(p.match(module) for p in self.ignore_patterns):
            return None
        for test in (
            lambda g: module in g.names,
            lambda g: any(p.match(module) for p in g.patterns),
            lambda g: g.all_linear,
        ):
            found = [g for g in self.groups if test(g)]
            if len(found) > 1 and len({g.scheme for g in found}) > 1:
                raise ValueError(
                    f"compressed-tensors config groups {', '.join(g.name for g in found)} "
                    f"all target {module} with different schemes"
                )
            if found:
                return found[0].scheme
        return None

    def tensors(self, scheme, out_features, in_features):
        n, k = out_features, in_features
        if scheme.weight_type == "fp8":
            return _fp8_tensors(scheme, n, k)
        groups = _num_groups(scheme, k)
        scales = ((n, groups),) if scheme.group_size or groups > 1 else ((n, 1),)
        if scheme.per_tensor:
            scales = ((1,), (1, 1), ())
        specs = {"weight_scale": TensorSpec(SCALE_DTYPES, scales, what="the scales")}
        if scheme.format.endswith(PACKED):
            words = -(-k * scheme.bits // 32)
            specs["weight_packed"] = TensorSpec((torch.int32,), ((n, words),), what="the codes")
            specs["weight_shape"] = TensorSpec(
                (torch.int64, torch.int32), ((2,),), what="the weight's shape"
            )
            zero_shape = (-(-n * scheme.bits // 32), groups)
            zero_dtype = torch.int32
            if scheme.per_tensor:  # compressed-tensors packs only channel and group zeros
                zero_shape, zero_dtype = scales[0], torch.int8
        else:
            specs["weight"] = TensorSpec((torch.int8,), ((n, k),), what="the codes")
            zero_shape, zero_dtype = scales[0], torch.int8
        if not scheme.symmetric:
            specs["weight_zero_point"] = TensorSpec(
                (zero_dtype,), (zero_shape,), what="the zero points"
            )
        if scheme.act_order:
            specs["weight_g_idx"] = TensorSpec(
                (torch.int32, torch.int64), ((k,),), required=False, what="the input groups"
            )
        return specs

    def decode(self, scheme, tensors, out_features, in_features):
        n, k = out_features, in_features
        if scheme.weight_type == "fp8":
            return fp8_weight(
                "weight", tensors["weight"], tensors["weight_scale"], _fp8_block(scheme, n, k)
            )
        half = 1 << (scheme.bits - 1)
        groups = _num_groups(scheme, k)
        if "weight_packed" in tensors:
            stored = tuple(int(v) for v in tensors["weight_shape"].tolist())
            if stored != (n, k):
                raise ValueError(f"weight_shape says {stored}, the model's layer is {(n, k)}")
            q = unpack_int32(tensors["weight_packed"], scheme.bits, k).sub_(half)
        else:
            q = tensors["weight"].to(torch.int16)
            if int(q.min()) < -half or int(q.max()) >= half:
                raise ValueError(f"weight holds codes outside {scheme.bits} bits")
        zero = tensors.get("weight_zero_point")
        if zero is not None:
            if zero.dtype == torch.int32:  # packed along the output channels
                zero = unpack_int32(zero.t(), scheme.bits, n).t() - half
            zero = zero.to(torch.int16).reshape(-1, groups).expand(n, groups).contiguous()
        scale = tensors["weight_scale"].reshape(-1, groups).expand(n, groups)
        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None:
            g_idx = g_idx.long()
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(f"weight_g_idx names groups outside 0..{groups - 1}")
        group_size = scheme.group_size or k
        return IntWeight(q, scale.contiguous(), zero, group_size, scheme.bits, g_idx)


def _fp8_block(scheme: LayerScheme, n: int, k: int) -> tuple[int, int]:
    """The outputs and inputs each of an FP8 layer's scales covers."""
    if scheme.block is not None:
        return scheme.block
    return (n, k) if scheme.per_tensor else (1, k)


def _fp8_tensors(scheme: LayerScheme, n: int, k: int) -> dict[str, TensorSpec]:
    bn, bk = _fp8_block(scheme, n, k)
    grid = (-(-n // bn), -(-k // bk))
    scales = ((1,), (1, 1), ()) if scheme.per_tensor else (grid,)
    if grid[1] == 1 and not scheme.per_tensor:
        scales = (grid, (n,))
    return {
        "weight": TensorSpec((torch.float8_e4m3fn,), ((n, k),), what="the fp8 codes"),
        "weight_scale": TensorSpec(SCALE_DTYPES, scales, what="the scales"),
    }


def _num_groups(scheme: LayerScheme, k: int) -> int:
    return -(-k // scheme.group_size) if scheme.group_size else 1


class CompressedTensors(CheckpointFormat):
    name = "compressed-tensors"

    def accepts(self, settings: dict) -> bool:
        method = str(settings.get("quant_method", "")).lower()
        return method == "compressed-tensors" or "config_groups" in settings

    def parse(self, settings: dict) -> CompressedTensorsReader:
        for key, what in (
            ("sparsity_config", "2:4 and other sparse weights"),
            ("kv_cache_scheme", "FP8/int8 KV-cache scales (use --kv-cache-dtype int8 instead)"),
            ("transform_config", "rotation transforms (SpinQuant/QuIP)"),
        ):
            if settings.get(key):
                raise ValueError(f"compressed-tensors {key}: {what} are not read; {_NEAREST} is")
        status = settings.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors quantization_status {status!r}: only compressed "
                "checkpoints are read (save with save_compressed=True)"
            )
        default = str(settings.get("format") or "dense")
        groups = [
            _parse_group(name, group, default)
            for name, group in (settings.get("config_groups") or {}).items()
        ]
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        return CompressedTensorsReader(groups, list(settings.get("ignore") or []))


def _parse_group(name: str, group: dict, default_format: str) -> _Group:
    fmt = str(group.get("format") or default_format)
    where = f"compressed-tensors group {name}"
    if fmt in _REFUSED_FORMATS:
        raise ValueError(f"{where}: format {fmt} - {_REFUSED_FORMATS[fmt]}")
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not read; {_NEAREST} is")
    weights = group.get("weights") or {}
    if not weights:
        raise ValueError(f"{where} quantizes no weights (activations only); {_NEAREST} is read")
    if fmt == FLOAT or (fmt == NAIVE and weights.get("type") == "float"):
        # compressed-tensors saves FP8 weights without FP8 activations as naive-quantized
        return _parse_fp8_group(name, group, where, fmt)
    wtype, bits = weights.get("type", "int"), weights.get("num_bits")
    if wtype != "int":
        raise ValueError(f"{where}: {wtype} weights are not read; {_NEAREST} is")
    if bits not in (4, 8):
        raise ValueError(f"{where}: {bits}-bit weights are not run; 4- and 8-bit ones are")
    if fmt != PACKED and bits != 8:
        raise ValueError(f"{where}: {fmt} with {bits}-bit weights is not read; pack-quantized is")
    if weights.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight scales are not read")
    strategy = weights.get("strategy")
    group_size = weights.get("group_size")
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{where}: strategy group needs a positive group_size")
    elif strategy in ("channel", "tensor"):
        group_size = None
    else:
        raise ValueError(
            f"{where}: weight strategy {strategy!r} is not read; group, channel and tensor are"
        )
    actorder = weights.get("actorder")
    if actorder not in (None, "static", "weight", "group", False):
        raise ValueError(f"{where}: actorder {actorder!r} is not read")
    for key in ("block_structure",):
        if weights.get(key):
            raise ValueError(f"{where}: weights {key} {weights[key]} is not read")
    activations = _activations(where, group.get("input_activations"))
    if group.get("output_activations"):
        raise ValueError(f"{where}: quantized output activations are not run")
    symmetric = bool(weights.get("symmetric", True))
    if activations is not None and (bits != 8 or strategy == "group" or not symmetric):
        raise ValueError(
            f"{where}: int8 activations need symmetric per-channel 8-bit weights (the int8 "
            f"kernels' layout), not {'symmetric' if symmetric else 'asymmetric'} {bits}-bit "
            f"{strategy}; W8A8 with strategy channel and symmetric weights is read"
        )
    scheme = LayerScheme(
        format=f"compressed-tensors {fmt}",
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        activations=activations,
        act_order=actorder == "group",
        per_tensor=strategy == "tensor",
    )
    return _targets(name, group, scheme, where)


def _targets(name: str, group: dict, scheme: LayerScheme, where: str) -> _Group:
    """The group with the layers it targets."""
    targets = list(group.get("targets") or [])
    names = frozenset(t for t in targets if not t.startswith("re:") and t != "Linear")
    classes = [t for t in names if "." not in t and not t.startswith("lm_head")]
    if classes:
        raise ValueError(
            f"{where} targets modules by class {', '.join(sorted(classes))}; only Linear, layer "
            "names and re: patterns are read"
        )
    patterns = tuple(re.compile(t[3:]) for t in targets if t.startswith("re:"))
    return _Group(name, scheme, names, patterns, "Linear" in targets)


def _parse_fp8_group(name: str, group: dict, where: str, fmt: str) -> _Group:
    """A group of FP8 e4m3 weights (float-quantized, or naive-quantized where its
    activations are not FP8) per channel, per tensor or in blocks."""
    weights = group["weights"]
    wtype, bits = weights.get("type"), weights.get("num_bits")
    if (wtype, bits) != ("float", 8):
        raise ValueError(
            f"{where}: {fmt} with {bits}-bit {wtype} weights is not read; 8-bit "
            "float (e4m3) weights are"
        )
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise ValueError(f"{where}: dynamic or asymmetric FP8 weight scales are not read")
    strategy, block = weights.get("strategy"), None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not (
            isinstance(structure, list)
            and len(structure) == 2
            and all(isinstance(v, int) and v > 0 for v in structure)
        ):
            raise ValueError(f"{where}: strategy block needs a block_structure [rows, cols]")
        block = (structure[0], structure[1])
    elif strategy not in ("channel", "tensor"):
        raise ValueError(
            f"{where}: FP8 weight strategy {strategy!r} is not read; channel, tensor and block are"
        )
    if group.get("output_activations"):
        raise ValueError(f"{where}: quantized output activations are not run")
    scheme = LayerScheme(
        format=f"compressed-tensors {fmt}",
        bits=8,
        group_size=None,
        symmetric=True,
        activations=_fp8_activations(where, group.get("input_activations")),
        per_tensor=strategy == "tensor",
        weight_type="fp8",
        block=block,
    )
    return _targets(name, group, scheme, where)


def _fp8_activations(where: str, settings: dict | None) -> str | None:
    return _token_activations(where, settings, "float", "FP8 input activations", FP8_DYNAMIC)


def _activations(where: str, settings: dict | None) -> str | None:
    return _token_activations(where, settings, "int", "input activations", INT8_DYNAMIC)


# The one activation scheme each kind runs: (what it is called, what the layer is told).
FP8_DYNAMIC = ("dynamic per-token FP8 (FP8_DYNAMIC)", "fp8-token")
INT8_DYNAMIC = ("dynamic symmetric per-token int8 (W8A8)", "int8-token")


def _token_activations(
    where: str, settings: dict | None, kind: str, what: str, runs: tuple[str, str]
) -> str | None:
    """The layer's activation scheme for `input_activations` settings, or None when the
    checkpoint quantizes no activations; anything but dynamic symmetric 8-bit per-token
    quantization of `kind` is refused naming the field."""
    if not settings:
        return None
    want = {"type": kind, "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    for key, value in want.items():
        if settings.get(key, True if key == "symmetric" else None) != value:
            raise ValueError(
                f"{where}: {what} with {key} {settings.get(key)!r} are not run; {runs[0]} is"
            )
    return runs[1]


register_format(CompressedTensors())
