"""The modules a checkpoint's quantized layers run as, chosen per layer from its scheme,
its shape and the engine's dtype:

- weights only, 4-bit, in a bf16 engine: Int4Linear (int4.py) - the int4 mode's own
  layer and kernels - on the checkpoint's codes and scales, exactly, wherever its groups
  split into the blocks PyTorch's int4 kernel takes (32, 64, 128 or 256 inputs that each
  lie in one group and tile the row; GPTQ's act-order groups once the inputs are put in
  group order, `PermutedInput`). The kernel computes in bf16, so the zero points' offsets
  are rounded to bf16, as the int4 mode's minimums are.
- int8 weights with dynamic per-token int8 activations (W8A8): Int8Linear (int8.py) - the
  int8 mode's kernels - on the checkpoint's int8 weights and per-channel scales, with no
  smoothing. Its activations are quantized per row as compressed-tensors quantizes them:
  a row's scale max|x| / 127.5 and the codes -128..127 (kernels/quantize.py's "full"
  rounding; the int8 mode's own is max|x| / 127, -127..127). The native kernel's plain
  AVX2 build has no -128 and rounds as the int8 mode does (`describe_kernels` says so).
- FP8 (e4m3) weights, in any engine: Fp8Linear (fp8.py), the codes dequantized inside
  the native fp8 kernel, with FP8 activations per token where the scheme has them.
- everything else, and every weights-only layer in an fp32 engine: ExactIntLinear, the
  codes and scales in memory, expanded per call - exactly (q - zero) * scale - a tile of
  rows at a time in fp32, or all rows rounded once to bf16 in a bf16 engine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import int8_linear
from tokenmill.engine.quant.checkpoint.fp8 import Fp8Linear, concat_fp8, describe_fp8_kernels
from tokenmill.engine.quant.checkpoint.weights import Fp8Weight, IntWeight, LayerScheme
from tokenmill.engine.quant.gguf_linear import RowConcat
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.int8 import INT8_KERNELS, choose_kernel, describe_kernel

# compressed-tensors' rounding of a token's activations (kernels/quantize.py's ROUNDINGS).
_CHECKPOINT_ROUNDING = "full"

# PyTorch's int4 kernel's group sizes, largest first.
_INT4_BLOCKS = (256, 128, 64, 32)
# Output rows expanded to fp32 at once: 256 x 2,048 inputs is 2 MB.
_ROWS_PER_TILE = 256


class ExactIntLinear(nn.Module):
    """y = x @ W^T + bias with W = (q - zero) * scale kept as int8 codes and per-group
    scales, expanded inside each call (module docstring)."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        self.register_buffer("q", weight.q.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scale", weight.scale.float().contiguous(), persistent=False)
        zero = None if weight.zero is None else weight.zero.float().contiguous()
        self.register_buffer("zero", zero, persistent=False)
        self.register_buffer("groups", weight.input_groups().contiguous(), persistent=False)
        self.bias = None if bias is None else bias.detach().float()
        num_scales = self.scale.numel() * (1 + (zero is not None))
        self.weight_bytes = self.q.numel() + 4 * num_scales

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Output rows [lo, hi) of the weight in fp32, each value (q - zero) * scale."""
        codes = self.q[lo:hi].float()
        if self.zero is not None:
            codes -= self.zero[lo:hi][:, self.groups]
        return codes.mul_(self.scale[lo:hi][:, self.groups])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dtype == torch.bfloat16:
            # A bf16 engine would hold these weights rounded to bf16: expand them so for one
            # bf16 matmul; the copy lives for the call.
            weight = self.rows(0, self.out_features).to(torch.bfloat16)
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            y = F.linear(x.reshape(-1, self.in_features), weight, bias)
            return y.view(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).float()
        out = torch.empty(x2.shape[0], self.out_features)
        for lo in range(0, self.out_features, _ROWS_PER_TILE):
            hi = min(lo + _ROWS_PER_TILE, self.out_features)
            bias = None if self.bias is None else self.bias[lo:hi]
            out[:, lo:hi] = F.linear(x2, self.rows(lo, hi), bias)
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits} codes expanded per call"
        )


class PermutedInput(nn.Module):
    """A layer whose inputs were put in another order (GPTQ's act-order groups made
    contiguous): y = layer(x[..., order])."""

    def __init__(self, layer: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("order", order.contiguous(), persistent=False)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight_bytes = layer.weight_bytes + 8 * order.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.index_select(-1, self.order))


def describe_kernels(scheme: LayerScheme) -> str:
    """The kernels a scheme's layers run on here, in words (`tokenmill models info`)."""
    if scheme.weight_type == "fp8":
        return describe_fp8_kernels(scheme.activations)
    if scheme.activations == "int8-token":
        kernel = "native" if int8_linear.native_int8_isa() is not None else "onednn"
        rounding = (
            "max|x|/127.5, -128..127 as compressed-tensors"
            if _activation_rounding(kernel) == _CHECKPOINT_ROUNDING
            else "max|x|/127, -127..127: this CPU's AVX2 kernel has no -128"
        )
        return f"int8 kernels ({describe_kernel(kernel)}), activations per token ({rounding})"
    expanded = "fp32: codes expanded per call (exact)"
    if scheme.bits == 4:
        return f"bf16: PyTorch's int4 kernel (Int4Linear) where the groups fit it; {expanded}"
    return f"bf16: codes expanded to bf16 per call; {expanded}"


def build_layer(
    parts: list[IntWeight | Fp8Weight | torch.Tensor],
    schemes: list[LayerScheme | None],
    bias: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    gated_activation: str | None = None,
) -> nn.Module:
    """The module that runs a layer's parts (a fused projection's q, k, v or gate, up, in
    row order; one part otherwise), each an IntWeight or a float weight, with the fused
    bias.

    Args:
        parts: the decoded weights.
        schemes: each part's scheme (None for a float part).
        bias: [sum of rows] or None.
        dtype: the engine's float dtype.
        gated_activation: the MLP's activation, for a gate_up layer that an int8 kernel
            may apply in its epilogue.
    """
    if len(set(schemes)) == 1 and schemes[0] is not None:
        scheme = schemes[0]
        if len(parts) > 1 and dtype == torch.bfloat16 and scheme.activations is None:
            fused = _int4_from_parts(parts, bias)
            if fused is not None:
                return fused
        merged = parts[0] if len(parts) == 1 else _concat(parts)
        if merged is not None:
            return _one_module(merged, scheme, bias, dtype, gated_activation)
    modules, row = [], 0
    for part, scheme in zip(parts, schemes):
        rows = part.shape[0]
        part_bias = None if bias is None else bias[row : row + rows]
        if scheme is None:
            modules.append(_float_linear(part, part_bias, dtype))
        else:
            modules.append(_one_module(part, scheme, part_bias, dtype, None))
        row += rows
    return RowConcat(modules)


def _one_module(weight, scheme, bias, dtype, gated_activation) -> nn.Module:
    if isinstance(weight, Fp8Weight):
        return Fp8Linear(weight, bias, scheme.activations)
    if scheme.activations == "int8-token":
        n, k = weight.shape
        kernel = choose_kernel(n, k)
        scale = weight.scale[:, 0].float()
        return INT8_KERNELS[kernel](
            weight.q.to(torch.int8),
            scale,
            bias,
            gated_activation=gated_activation,
            rounding=_activation_rounding(kernel),
        )
    if dtype == torch.bfloat16 and weight.bits == 4:
        fast = as_int4_linear(weight, bias)
        if fast is not None:
            return fast
    return ExactIntLinear(weight, bias)


def _activation_rounding(kernel: str) -> str:
    """The rounding a W8A8 layer's activations get on `kernel`: compressed-tensors' own,
    but on the native kernel's plain AVX2 build, which has no -128."""
    if kernel == "native" and not int8_linear.takes_full_rounding():
        return "symmetric"
    return _CHECKPOINT_ROUNDING


def as_int4_linear(weight: IntWeight, bias: torch.Tensor | None) -> nn.Module | None:
    """A 4-bit weight on Int4Linear (module docstring), or None where its groups do not
    fit PyTorch's int4 kernel."""
    n, k = weight.shape
    order = None
    if weight.g_idx is not None:
        order = torch.sort(weight.g_idx, stable=True).indices
        in_order = torch.arange(k) // weight.group_size
        if not torch.equal(weight.g_idx[order], in_order):
            return None  # groups of uneven sizes: only the exact layer reads them
        weight = IntWeight(weight.q[:, order], weight.scale, weight.zero, weight.group_size, 4)
        if torch.equal(order, torch.arange(k)):
            order = None
    block = next((b for b in _INT4_BLOCKS if k % b == 0 and weight.group_size % b == 0), None)
    if block is None or n % 16:
        return None
    per_block = torch.arange(0, k, block) // weight.group_size  # each block's group
    scale = weight.scale.float()[:, per_block]
    zero = 0 if weight.zero is None else weight.zero.float()[:, per_block]
    minimum = (-8 - zero) * scale  # value = (q + 8) * scale + minimum
    codes = weight.q.to(torch.int32).add_(
        8
    )  # in place: a weight's int32 copy is the largest temporary
    layer = Int4Linear(codes, scale, minimum, bias, group_size=block)
    return layer if order is None else PermutedInput(layer, order)


def _int4_from_parts(parts: list, bias: torch.Tensor | None) -> nn.Module | None:
    """A fused 4-bit layer (gate_up, qkv) on Int4Linear built part by part into its final
    buffer (Int4Linear.from_parts), or None where as_int4_linear's own route applies:
    act-order groups, groups that do not fit the kernel, parts of other widths or groups."""
    first = parts[0]
    if not all(
        isinstance(p, IntWeight)
        and p.bits == 4
        and p.g_idx is None
        and p.group_size == first.group_size
        for p in parts
    ):
        return None
    n, k = sum(p.shape[0] for p in parts), first.shape[1]
    block = next((b for b in _INT4_BLOCKS if k % b == 0 and first.group_size % b == 0), None)
    if block is None or n % 16:
        return None
    per_block = torch.arange(0, k, block) // first.group_size  # each block's group
    scale = torch.cat([p.scale.float()[:, per_block] for p in parts])
    zero = torch.cat(
        [
            torch.zeros(p.shape[0], len(per_block))
            if p.zero is None
            else p.zero.float()[:, per_block]
            for p in parts
        ]
    )
    minimum = (-8 - zero) * scale  # value = (q + 8) * scale + minimum, as as_int4_linear
    return Int4Linear.from_parts(
        [p.q for p in parts], scale, minimum, bias, group_size=block, offset=8
    )


def _concat(parts: list[IntWeight | Fp8Weight]) -> IntWeight | Fp8Weight | None:
    """Parts of one scheme as one weight, their rows one after another (None where their
    groups differ, as act-order groups of separate layers do)."""
    if isinstance(parts[0], Fp8Weight):
        return concat_fp8(parts)
    first = parts[0]
    same_groups = all(
        p.g_idx is None if first.g_idx is None else torch.equal(p.g_idx, first.g_idx) for p in parts
    )
    if not same_groups:
        return None
    zero = None
    if any(p.zero is not None for p in parts):
        zero = torch.cat(
            [
                torch.zeros(p.scale.shape, dtype=torch.int16) if p.zero is None else p.zero
                for p in parts
            ]
        )
    mixed_dtypes = len({p.scale.dtype for p in parts}) > 1
    scales = [p.scale.float() if mixed_dtypes else p.scale for p in parts]
    return IntWeight(
        torch.cat([p.q for p in parts]),
        torch.cat(scales),
        zero,
        first.group_size,
        first.bits,
        first.g_idx,
    )


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    linear.weight_bytes = weight.numel() * linear.weight.element_size()  # for RowConcat
    return linear
