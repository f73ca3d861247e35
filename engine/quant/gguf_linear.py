"""`quantization="gguf"`: the decoder layers run the GGUF's own quantized weights.

The 4-bit formats (Q4_0, Q4_1, Q4_K: a scale and an offset per 32 weights) run as
Q4Linear where the native library has its 4-bit product (kernels/q4_linear.c) and the
block's scales and offsets are fp16 values (Q4_0 and Q4_1 always): integer dot products
on the file's own nibbles with the activations quantized per block of 32, llama.cpp's
arithmetic for these formats - except, on CPUs with AMX bf16 tiles, for bf16 calls of
TILES_MIN_ROWS rows or more, which run on the tiles (kernels/q4_tiles.c: the blocks'
exact dequantized values, fp32 sums), and of EXPAND_MIN_ROWS or more, which expand the
weights to bf16 (from the fp16 scales) for one bf16 matmul (docs/design.md, "4-bit GGUF
layers in integer dot products"). Elsewhere they are exactly what PyTorch's int4 CPU kernel
computes (int4.py), so they run as Int4Linear: that kernel for small calls, the weights
expanded to bf16 for one bf16 matmul from int4.py's UNPACK_MIN_ROWS rows on (on CPUs with
native bf16). Its fast variant is bf16, so the fp16 scales and offsets are rounded to
bf16 (relative 2^-9, against the 4-bit rounding of the weights themselves) and the rows
must come in multiples of 16.

The 5-, 6- and 8-bit formats (Q5_0, Q6_K, Q8_0), and 4-bit ones of other widths, keep
their integers and per-group scales in memory and are expanded inside each product
(GroupedLinear): in a bf16 engine the whole weight to bf16 for one bf16 matmul, in fp32
a tile of rows at a time - the same values as the float mode's, a fraction of the
memory, at about float's speed; no maintained kernel takes int8 weights with a scale per
group. A fused projection whose parts differ in format (q, k and v; gate and up) runs
one module per part and concatenates their outputs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import cpu_flags
from tokenmill.engine.kernels import q4_linear as native_q4
from tokenmill.engine.loader import gguf_blocks
from tokenmill.engine.loader.gguf_blocks import BLOCK_FORMATS, DecodedWeight
from tokenmill.engine.loader.gguf_tensors import GGUFTensors, gguf_source
from tokenmill.engine.loader.tensor_plan import TensorSource
from tokenmill.engine.loader.weights import HoldOut
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.quant.gguf_embedding import (
    build_block_embedding,
    embedding_block_bytes,
    hold_out_embedding,
)
from tokenmill.engine.quant.gguf_head import BlockHead, build_block_head, hold_out_head
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.int8 import held_int8_bytes, quantize_lm_head
from tokenmill.engine.quant.method import HeldOutBytes, QuantizationMethod, register

INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# From this many rows a Q4Linear call on a CPU with AMX expands its weights to bf16 and
# runs the bf16 matmul on the tiles instead of the integer product on the vector units
# (where the two cross: docs/design.md, "4-bit GGUF layers in integer dot
# products"). Without AMX the integer product is the faster one at every row count.
EXPAND_MIN_ROWS = 256
# From this many rows (below EXPAND_MIN_ROWS) a bf16 call on a CPU with AMX runs the
# blocks on the bf16 tiles without expanding them (kernels/q4_tiles.c): the integer
# product's multiply-adds, not the weights' bytes, bound a decode batch of this size.
TILES_MIN_ROWS = 48
# Output rows expanded to fp32 at once in GroupInt8Linear: 256 x 2,048 inputs is 2 MB.
_ROWS_PER_TILE = 256
# Our fused parameters -> the HF parts they are made of, in row order.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class GroupedLinear(nn.Module):
    """y = x @ W^T with W = scale[n, k // g] * q[n, k] (+ offset[n, k // g]) kept as int8
    and fp32 scales (and offsets)."""

    def __init__(self, weight: DecodedWeight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.group = weight.group
        self.register_buffer("q", weight.q.contiguous(), persistent=False)
        self.register_buffer("scale", weight.scale.contiguous(), persistent=False)
        offset = None if weight.offset is None else weight.offset.contiguous()
        self.register_buffer("offset", offset, persistent=False)
        self.weight_bytes = self.q.numel() + 4 * self.scale.numel() * (1 + (offset is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dtype == torch.bfloat16:
            # A bf16 engine's weights are bf16 anyway (its float mode rounds the same
            # decoded values once): expand the whole weight for this call and run the bf16
            # matmul - AMX or AVX512-BF16 in oneDNN, several times fp32's rate - instead of
            # fp32 tiles. The copy lives for the one call.
            weight = self._rows(0, self.out_features).to(torch.bfloat16)
            out = F.linear(x.reshape(-1, self.in_features), weight)
            return out.view(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).float()
        out = torch.empty(x2.shape[0], self.out_features)
        for lo in range(0, self.out_features, _ROWS_PER_TILE):
            hi = min(lo + _ROWS_PER_TILE, self.out_features)
            out[:, lo:hi] = F.linear(x2, self._rows(lo, hi))
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """Output rows [lo, hi) of the weight, decoded to fp32."""
        offset = None if self.offset is None else self.offset[lo:hi]
        return DecodedWeight(self.q[lo:hi], self.scale[lo:hi], offset, self.group).dequantize()


class Q4Linear(nn.Module):
    """A 4-bit GGUF layer on the native 4-bit product (module docstring); output in the
    input's dtype."""

    def __init__(self, packed: native_q4.PackedQ4Weight) -> None:
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self.weight_bytes = packed.nbytes
        self.expand_min_rows = EXPAND_MIN_ROWS if "amx_bf16" in cpu_flags() else None
        self.tiles_min_rows = TILES_MIN_ROWS if native_q4.tiles_available() else None
        self._bias16 = None if packed.bias is None else packed.bias.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        rows, is_bf16 = x2.shape[0], x2.dtype == torch.bfloat16
        if is_bf16 and self.expand_min_rows is not None and rows >= self.expand_min_rows:
            y = F.linear(x2, native_q4.unpack_q4_bf16(self.packed), self._bias16)
        elif is_bf16 and self.tiles_min_rows is not None and rows >= self.tiles_min_rows:
            y = native_q4.q4_linear_tiles(x2, self.packed)
        else:
            y = native_q4.q4_linear(x2, self.packed)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        blocks = "affine (Q4_1)" if self.packed.affine else "symmetric (Q4_0)"
        return f"in_features={self.in_features}, out_features={self.out_features}, {blocks}"


def as_q4(weights: list[DecodedWeight], kinds: list[str], bias) -> Q4Linear | None:
    """The weights (a fused projection's parts, in row order) as one Q4Linear, or None
    where the native 4-bit product cannot take them: not built here, a shape it does not
    take, or scales and offsets that are not fp16 values (Q4_K's products of two)."""
    rows = sum(w.q.shape[0] for w in weights)
    if not all(k in INT4_FORMATS for k in kinds) or not native_q4.takes_shape(
        rows, weights[0].q.shape[1]
    ):
        return None
    q, scale, minimum = (torch.cat(t) for t in zip(*map(as_int4, weights, kinds)))
    symmetric = all(k == "Q4_0" for k in kinds)
    if not native_q4.exact_in_fp16(scale) or not (symmetric or native_q4.exact_in_fp16(minimum)):
        return None
    packed = native_q4.pack_q4_weight(q, scale, None if symmetric else minimum, bias)
    return Q4Linear(packed)


class RowConcat(nn.Module):
    """A fused projection whose parts are different modules: outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.weight_bytes = sum(p.weight_bytes for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def check_gguf_blocks(model_dir: Path) -> None:
    """Raise ValueError unless model_dir has GGUF blocks in formats we run."""
    types = _block_types(model_dir)
    if not types:
        raise ValueError(
            f"quantization='gguf' needs a model converted from a GGUF file with quantized "
            f"layers; {model_dir} has none (use int8 or int4 for other models)"
        )
    unsupported = sorted(set(types.values()) - set(BLOCK_FORMATS))
    if unsupported:
        raise ValueError(
            f"quantization='gguf' runs {', '.join(BLOCK_FORMATS)}; this GGUF has "
            f"{', '.join(unsupported)}"
        )


class _BlockSource:
    """Where a model's GGUF blocks are read from: the GGUF file itself (a model that runs
    from its file), or the blocks file of a directory exported by `convert_gguf`."""

    def __init__(self, model_dir: Path) -> None:
        gguf_path = gguf_source(model_dir)
        self.model_dir = model_dir
        self.gguf = None if gguf_path is None else GGUFTensors.open_dir(model_dir)

    def types(self) -> dict[str, str]:
        if self.gguf is not None:
            return self.gguf.block_types()
        return gguf_blocks.read_types(self.model_dir) or {}

    def raw(self, hf_names: list[str]) -> dict[str, torch.Tensor]:
        if self.gguf is not None:
            return self.gguf.raw_blocks(hf_names)
        return gguf_blocks.load_raw(self.model_dir, hf_names)


def _block_types(model_dir: Path) -> dict[str, str]:
    return _BlockSource(model_dir).types()


class PendingBlocks(nn.Module):
    """Stands in for a decoder linear layer whose weights the GGUF keeps as blocks, from
    the load's hold-out until `load_gguf_layers` builds it: the float load fills only its
    bias (a meta `bias` parameter where the layer has one), never its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a GGUF layer was used before its blocks were loaded")


def blocks_hold_out(model_dir: Path) -> HoldOut | None:
    """The load's hold-out for a model that runs from its GGUF file: every decoder linear
    layer whose parts are all blocks the mode runs becomes a PendingBlocks, and their
    weights are left out of the float load. None for an exported directory (its float
    copies are loaded and swapped after, as they were written)."""
    if gguf_source(model_dir) is None:
        return None

    def hold_out(model: nn.Module, sources: list[TensorSource]) -> frozenset[str]:
        types = _block_types(model_dir)
        held: set[str] = set()
        for _parent, _name, _linear, hf_names in _block_layers(model, types, nn.Linear):
            held.update(hf_names)
            setattr(_parent, _name, PendingBlocks(_linear))
        return frozenset(held)

    return hold_out


# Each block format's decoded layout (gguf_blocks.decode): the group of weights one fp32
# scale covers, and whether the group also has an fp32 offset.
_DECODED_GROUPS = {
    "Q8_0": (32, False),
    "Q4_0": (32, False),
    "Q4_1": (32, True),
    "Q5_0": (32, False),
    "Q4_K": (32, True),
    "Q6_K": (16, False),
}


def built_bytes_bound(kind: str, rows: int, columns: int, stored: int) -> int:
    """The most bytes `gguf_module` can build from a [rows, columns] weight stored as
    `stored` bytes of `kind` blocks: which module it builds depends on the scales' values
    and the kernel (as_q4 keeps 4-bit blocks as they are stored), so the plan counts the
    largest of the modules it may choose - never less than the load will take."""
    weights = rows * columns
    group, has_offset = _DECODED_GROUPS[kind]
    grouped = weights + 4 * (weights // group) * (1 + has_offset)  # GroupedLinear
    if kind in INT4_FORMATS and rows % 16 == 0:
        int4 = weights // 2 + 4 * (weights // 32)  # Int4Linear: codes, bf16 scale and minimum
        return max(stored, int4)
    return max(stored, grouped)


def held_out_block_bytes(model_dir: Path) -> HeldOutBytes | None:
    """For the memory plan: each layer `blocks_hold_out` leaves out of the float load,
    with the most bytes its module can take once built from the GGUF's blocks
    (`built_bytes_bound`, the fused parts summed), read from the tensor table alone. None
    where blocks_hold_out holds nothing out."""
    if gguf_source(model_dir) is None:
        return None

    def planned(model: nn.Module) -> dict[nn.Module, int]:
        tensors = GGUFTensors.open_dir(model_dir)
        types, sizes = tensors.block_types(), tensors.stored_bytes()
        found = _block_layers(model, types, nn.Linear)
        # A fused projection's parts may differ in rows (q, k, v): each part's rows are
        # its stored bytes over the bytes of one stored row.
        return {
            linear: sum(
                built_bytes_bound(
                    types[n],
                    _stored_rows(types[n], sizes[n], linear.in_features),
                    linear.in_features,
                    sizes[n],
                )
                for n in hf_names
            )
            for _parent, _name, linear, hf_names in found
        }

    return planned


def _stored_rows(kind: str, nbytes: int, columns: int) -> int:
    per_block, block_bytes = BLOCK_FORMATS[kind]
    return nbytes // (columns // per_block * block_bytes)


def _block_layers(model: nn.Module, types: dict[str, str], kinds):
    """(parent, attribute, layer, HF weight names) of each decoder layer module of `kinds`
    whose every part the GGUF stores as blocks of a format the mode runs."""
    found = []
    for index, layer in enumerate(model.model.layers):
        for parent in layer.modules():
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, kinds):
                    continue
                prefix = _hf_prefix(model, parent, index)
                parts = _FUSED.get(name, (name,))
                hf_names = [f"{prefix}.{part}.weight" for part in parts]
                if all(types.get(n) in BLOCK_FORMATS for n in hf_names):
                    found.append((parent, name, linear, hf_names))
    return found


def as_int4(weight: DecodedWeight, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit format as Int4Linear's (q in 0..15, scale, minimum): value = q * scale + minimum."""
    if kind == "Q4_0":  # q in -8..7 without offset: shift up, the minimum is -8 * scale
        return weight.q.int() + 8, weight.scale, -8 * weight.scale
    return weight.q.int(), weight.scale, weight.offset


def gguf_module(
    weights: list[DecodedWeight], kinds: list[str], bias: torch.Tensor | None
) -> nn.Module:
    """The module that runs these weights' rows one after another (a fused projection's
    parts, or one weight), with the fused bias."""
    rows = sum(w.q.shape[0] for w in weights)
    native = as_q4(weights, kinds, bias)
    if native is not None:
        return native
    if rows % 16 == 0 and all(k in INT4_FORMATS for k in kinds):
        q, scale, minimum = (torch.cat(t) for t in zip(*map(as_int4, weights, kinds)))
        return Int4Linear(q, scale, minimum, bias, group_size=32)
    groups = {w.group for w in weights}
    if len(groups) == 1 and len({w.offset is None for w in weights}) == 1:
        merged = DecodedWeight(
            torch.cat([w.q for w in weights]),
            torch.cat([w.scale for w in weights]),
            None if weights[0].offset is None else torch.cat([w.offset for w in weights]),
            groups.pop(),
        )
        module = GroupedLinear(merged)
        return module if bias is None else _WithBias(module, bias)
    parts, row = [], 0
    for weight, kind in zip(weights, kinds):
        rows = weight.q.shape[0]
        part_bias = None if bias is None else bias[row : row + rows]
        parts.append(gguf_module([weight], [kind], part_bias))
        row += rows
    return RowConcat(parts)


class _WithBias(nn.Module):
    def __init__(self, module: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.module = module
        self.bias = bias.detach()
        self.out_features = module.out_features
        self.weight_bytes = module.weight_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) + self.bias.to(x.dtype)


def load_gguf_layers(model: nn.Module, model_dir: Path, *, dtype: torch.dtype) -> int:
    """Swap each decoder linear whose GGUF weights are kept quantized (a float one, or
    the PendingBlocks the hold-out left); returns their bytes.

    Layers whose GGUF tensors are float (F32/F16) stay as they are.
    """
    source = _BlockSource(model_dir)
    types = source.types()
    total = 0
    for parent, name, linear, hf_names in _block_layers(model, types, (nn.Linear, PendingBlocks)):
        raw = source.raw(hf_names)
        kinds = [types[n] for n in hf_names]
        module = _q4_from_raw([raw[n] for n in hf_names], kinds, linear)
        if module is not None:
            setattr(parent, name, module)
            total += module.weight_bytes
            continue
        weights = [gguf_blocks.decode(raw[n], k) for n, k in zip(hf_names, kinds)]
        del raw
        rows = sum(w.q.shape[0] for w in weights)
        if rows != linear.out_features:
            raise ValueError(f"GGUF blocks of {hf_names[0]} have {rows} rows")
        module = gguf_module(weights, kinds, linear.bias)
        setattr(parent, name, module)
        total += module.weight_bytes
    left = [n for n, m in model.named_modules() if isinstance(m, PendingBlocks)]
    if left:
        raise ValueError(f"GGUF layers held out of the load but never built: {', '.join(left)}")
    return total


def _q4_from_raw(raw: list[torch.Tensor], kinds: list[str], linear: nn.Module) -> Q4Linear | None:
    """The layer as Q4Linear straight from its parts' raw blocks, where they are all Q4_0
    or all Q4_1 and the native 4-bit product takes the shape: the module gguf_module
    builds from their decoded weights (as_q4), byte for byte, in one pass without
    decoding. None otherwise (decoded and built by gguf_module)."""
    rows = sum(r.shape[0] for r in raw)
    kind = kinds[0]
    if kind not in ("Q4_0", "Q4_1") or any(k != kind for k in kinds):
        return None
    if rows != linear.out_features or not native_q4.takes_shape(rows, linear.in_features):
        return None
    merged = torch.cat(raw) if len(raw) > 1 else raw[0]
    # as_q4 leaves a NaN scale or minimum (not exact in fp16 by its test) to Int4Linear
    nbytes = BLOCK_FORMATS[kind][1]
    heads = merged.view(rows, -1, nbytes)[:, :, : 4 if kind == "Q4_1" else 2]
    halves = heads.contiguous().view(torch.int16).int() & 0x7FFF
    if bool((halves > 0x7C00).any()):
        return None
    return Q4Linear(native_q4.pack_gguf_q4_weight(merged, kind == "Q4_1", linear.bias))


def _hf_prefix(model: nn.Module, parent: nn.Module, index: int) -> str:
    """`model.layers.{index}.self_attn` / `.mlp` for a submodule of decoder layer index."""
    layer = model.model.layers[index]
    for name, module in layer.named_modules():
        if module is parent:
            return f"model.layers.{index}.{name}" if name else f"model.layers.{index}"
    raise ValueError("module is not inside the decoder layer")


class GGUFMethod(QuantizationMethod):
    """The GGUF's own quantized blocks, kept as they are (see module docstring)."""

    name = "gguf"
    help = "a GGUF model's own quantized blocks"
    layer_classes = (GroupedLinear, RowConcat, Int4Linear, Q4Linear)
    # The output layer is loaded in the engine's float dtype, whatever the file holds
    # (llama.cpp's 4-bit files keep it in Q8_0): at one sequence it is the largest read of
    # a step, so quantize_lm_head runs it as the int8 mode's smoothed int8 lm_head.
    quantizes_lm_head = True

    def check(self, model_dir: Path, config: ModelConfig, device: torch.device) -> None:
        super().check(model_dir, config, device)
        check_gguf_blocks(model_dir)

    def hold_out(self, model_dir: Path) -> HoldOut | None:
        layers = blocks_hold_out(model_dir)
        if layers is None:
            return None

        def hold_out(model: nn.Module, sources: list[TensorSource]) -> frozenset[str]:
            return (
                layers(model, sources)
                | hold_out_embedding(model_dir, model, sources)
                | hold_out_head(model_dir, model, sources)
            )

        return hold_out

    def held_out_bytes(self, model_dir: Path) -> HeldOutBytes | None:
        layers = held_out_block_bytes(model_dir)
        if layers is None:
            return None
        return lambda model: layers(model) | embedding_block_bytes(model_dir, model)

    def held_head_bytes(self):
        return held_int8_bytes

    def quantize(self, model, model_dir, *, dtype, measure_inputs, lm_head) -> int:
        total = load_gguf_layers(model, model_dir, dtype=dtype)
        total += build_block_embedding(model, model_dir)
        # Packed from its blocks by pack_linear_layers; int8 quantizes the float matrix.
        build_block_head(model, model_dir)
        if lm_head:
            if isinstance(model.lm_head, BlockHead):
                model.lm_head = model.lm_head.to_linear()
            total += quantize_lm_head(model, model_dir, measure_inputs)
        return total


register(GGUFMethod())
