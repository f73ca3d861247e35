"""int4 linear layers: group-wise 4-bit weights, bf16 activations.

Each run of `group_size` weights along a row keeps a scale and a minimum
(w ~ q * scale + minimum, q in 0..15, the GGUF Q4_1 recipe) and the product runs in
PyTorch's own CPU kernel for it (`torch._weight_int4pack_mm_for_cpu`), which reads a
quarter of bf16's bytes: the choice for jobs bound by memory bandwidth (small batches,
long outputs, bigger models). The kernel runs in bf16 whatever the model's dtype: its
fp32 variant is scalar and far slower, so the scales and the activations are rounded to
bf16 and the output cast back (docs/design.md, "int4 and GGUF layers on expanded
weights").

Calls of UNPACK_MIN_ROWS rows or more (prompt chunks, big decode batches) expand the
layer's weights to bf16 first (kernels/int4_unpack.c, one pass over N x K) and run the
bf16 matmul on them: that kernel computes far below the bf16 units' rate, and from a few
tens of rows the product, not the weights' bytes, is the cost. The expanded copy lives
for the one call, so the model keeps int4's memory. Only on CPUs that multiply bf16
themselves (config.cpu_has_fast_bf16: AVX512-BF16 or AMX): elsewhere (Ice Lake,
Cascade Lake, AVX2 CPUs) oneDNN widens a bf16 matmul to fp32 at a fraction of even the
int4 kernel's rate, so every call stays on the int4 kernel. Figures: docs/design.md
("int4 and GGUF layers on expanded weights", "bf16 without AVX512-BF16").
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.kernels import int4_unpack
from tokenmill.engine.loader.heap import return_freed_heap
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.models.moe import KernelExperts
from tokenmill.engine.quant.calibrate import ROWS_PER_CHUNK
from tokenmill.engine.quant.method import (
    QuantizationMethod,
    filled_layer_quantizer,
    quantized_targets,
    register,
)
from tokenmill.engine.types.config import cpu_has_fast_bf16

# Inputs per group of weights that share a scale and a minimum.
GROUP_SIZE = 32
# PyTorch's int4 layout stores each group as (q - 8) * scale + zero.
_MID = 8
COMPUTE_DTYPE = torch.bfloat16
# From this many rows a call expands the weights to bf16 and runs the bf16 matmul, on a
# CPU with native bf16 (where it pays: docs/design.md, "int4 and GGUF layers on expanded
# weights").
UNPACK_MIN_ROWS = 32


def quantize_weight(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scale [N, K // g], minimum [N, K // g]).

    weight ~ q * scale + minimum within each group of g consecutive inputs.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    # One fp32 copy (an fp32 weight copied too), worked on in place. (amin and amax are
    # two passes, but each runs far faster on the CPU than aminmax's one.)
    groups = weight.detach().to(torch.float32, copy=True).reshape(n, k // group_size, group_size)
    minimum = groups.amin(dim=-1)
    span = groups.amax(dim=-1) - minimum
    scale = torch.where(span > 0, span / 15, torch.ones_like(span))
    q = groups.sub_(minimum[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)
    return q.to(torch.int32).reshape(n, k), scale, minimum


class Int4Linear(nn.Module):
    """nn.Linear's forward on group-wise int4 weights; output in the input's dtype."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group_size: int,
        packed: tuple[torch.Tensor, bool] | None = None,
    ) -> None:
        """q: int32 [n, k] codes 0..15; packed: (q already packed, whether the layer
        unpacks) where `from_parts` packed it, q then only giving the shape."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        if packed is None:
            packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            packed = packed_weight, _layout_read(*q.shape)
        self.register_buffer("packed_weight", packed[0], persistent=False)
        zero = minimum.float() + _MID * scale.float()
        # [K // g, N, 2]: per group and output channel, (scale, zero).
        scales_and_zeros = torch.stack([scale.float().t(), zero.t()], dim=-1).contiguous()
        self.register_buffer(
            "scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE), persistent=False
        )
        self.bias = None if bias is None else bias.detach().to(COMPUTE_DTYPE)
        sz = self.scales_and_zeros
        self.weight_bytes = q.numel() // 2 + sz.numel() * sz.element_size()
        self.unpacks = packed[1]
        # The rows from which a call runs on expanded bf16 weights; None: the int4 kernel
        # at every size (no native unpacking, or bf16 matmuls emulated on this CPU).
        expands = self.unpacks and cpu_has_fast_bf16()
        self.unpack_min_rows = UNPACK_MIN_ROWS if expands else None

    @classmethod
    def from_parts(
        cls,
        parts: list[torch.Tensor],
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group_size: int,
        offset: int,
    ) -> Int4Linear | None:
        """One layer from its output rows' parts (a fused gate_up's gate and up codes,
        integers q with q + offset in 0..15), each widened to int32 and packed into the
        layer's buffer in turn: the load holds one part's int32 copy, never the whole
        layer's (the largest temporary of a quantized load). None where the parts do not
        fill whole int4pack blocks or PyTorch packs in a layout int4_unpack.c does not
        read (block-wise packing is what makes packing part by part the same bytes).

        Args:
            scale, minimum: [n, k / group_size] for all the parts' rows.
        """
        k = parts[0].shape[1]
        block = int4_unpack.BLOCK_N
        if not int4_unpack.available() or any(p.shape[0] % block for p in parts):
            return None
        n = sum(p.shape[0] for p in parts)
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        row = 0
        for part in parts:
            codes = part.to(torch.int32).add_(offset)
            one = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
            if not _layout_read(*codes.shape):
                return None
            packed[row : row + part.shape[0]] = one
            row += part.shape[0]
            del codes, one
        shape_only = torch.empty(n, k, dtype=torch.int32, device="meta")
        return cls(shape_only, scale, minimum, bias, group_size=group_size, packed=(packed, True))

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int = 32,
    ) -> Int4Linear:
        """A float weight [n, k] quantized and packed in one native pass where the kernels
        are built and PyTorch packs in the layout they write (_quantized_natively); else
        a chunk of ROWS_PER_CHUNK rows at a time where packing is block-wise (what `from_parts` relies on): the load then
        holds one chunk's fp32 and int32 temporaries, not the layer's - 4x and 2x an
        8B model's 235 MB bf16 gate_up. Same bytes as packing the whole."""
        n, k = weight.shape
        native = _quantized_natively(weight, group_size)
        if native is not None:
            packed, scale, minimum = native
            shape_only = torch.empty(n, k, dtype=torch.int32, device="meta")
            return cls(
                shape_only, scale, minimum, bias, group_size=group_size, packed=(packed, True)
            )
        chunks = weight.detach().split(ROWS_PER_CHUNK)
        if n <= ROWS_PER_CHUNK or not all(_layout_read(*c.shape) for c in chunks):
            q, scale, minimum = quantize_weight(weight, group_size)
            return cls(q, scale, minimum, bias, group_size=group_size)
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        scale = torch.empty(n, k // group_size)
        minimum = torch.empty(n, k // group_size)
        start = 0
        for rows in chunks:
            stop = start + rows.shape[0]
            q, scale[start:stop], minimum[start:stop] = quantize_weight(rows, group_size)
            packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            start = stop
            del q
        shape_only = torch.empty(n, k, dtype=torch.int32, device="meta")
        return cls(shape_only, scale, minimum, bias, group_size=group_size, packed=(packed, True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        if self.unpack_min_rows is not None and x2.shape[0] >= self.unpack_min_rows:
            weight = int4_unpack.unpack_int4_bf16(
                self.packed_weight, self.scales_and_zeros, self.group_size
            )
            y = torch.mm(x2, weight)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed_weight, self.group_size, self.scales_and_zeros
            )
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group {self.group_size}"
        )


def _quantized_natively(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(packed, scale, minimum) from int4_unpack.c's one pass over the weight - the same
    codes, scales and minimums as quantize_weight, packed as PyTorch packs them - or None
    where that pass does not apply: no native library, a dtype it does not read, channels
    that do not fill whole int4pack blocks, a PyTorch whose packing int4_unpack.c does not
    write (_layout_read), or a weight with a NaN or an infinity (left to quantize_weight,
    as it was before this pass)."""
    n, k = weight.shape
    if not int4_unpack.available() or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if group_size > int4_unpack.MAX_PACK_GROUP or k % group_size or n % int4_unpack.BLOCK_N:
        return None
    # PyTorch packs block by block of channels (what from_parts and the chunks of
    # from_float rely on too), so two blocks at this k stand for all n / 64 of them: the
    # probe costs a few hundred KB of codes, not a random copy of the layer.
    if not _layout_read(2 * int4_unpack.BLOCK_N, k):
        return None
    return int4_unpack.quantize_pack_int4(weight, group_size)


@functools.cache
def _layout_read(n: int, k: int) -> bool:
    """`_unpacks` for every [n, k] weight: packing places bits by position alone, whatever
    the codes, so one probe of seeded random codes per shape stands for all the weights of
    that shape (a model has a few shapes and hundreds of weights; the check is a pass over
    each one's codes)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(16, (n, k), dtype=torch.int32, generator=generator)
    return _unpacks(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), q)


def _unpacks(packed: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether big calls may expand these weights natively: the library is built, the
    channels fill whole int4pack blocks, and the packed bytes hold q in the layout
    int4_unpack.c reads (checked for every weight's shape: _layout_read; a PyTorch that
    packs differently keeps its own kernel rather than computing wrong products)."""
    n, k = q.shape
    block = int4_unpack.BLOCK_N
    if not int4_unpack.available() or n % block or packed.dtype != torch.uint8:
        return False
    if packed.shape != (n, k // 2) or not packed.is_contiguous():
        return False
    blocks = packed.view(n // block, k, block // 2)
    halves = q.reshape(n // block, 2, block // 2, k).transpose(2, 3)  # [nb, half, k, j]
    return bool(
        torch.equal((blocks & 15).to(q.dtype), halves[:, 0])
        and torch.equal((blocks >> 4).to(q.dtype), halves[:, 1])
    )


class Int4Method(QuantizationMethod):
    """Group-wise 4-bit weights (groups of GROUP_SIZE inputs), bf16 activations."""

    name = "int4"
    help = "group-wise 4-bit weights"
    layer_classes = (Int4Linear,)
    expert_format = "int4"

    def check(self, model_dir: Path, config: ModelConfig, device: torch.device) -> None:
        super().check(model_dir, config, device)
        q_size = config.num_attention_heads * config.head_dim
        inputs = {config.hidden_size, config.intermediate_size, q_size}
        bad = sorted(w for w in inputs if w % GROUP_SIZE)
        if bad:
            raise ValueError(
                f"quantization='int4' needs layer inputs that are multiples of "
                f"{GROUP_SIZE}; this model has {', '.join(map(str, bad))}"
            )
        # PyTorch's int4 kernel packs output rows in 16s.
        kv_size = config.num_key_value_heads * config.head_dim
        outputs = {q_size + 2 * kv_size, config.hidden_size, 2 * config.intermediate_size}
        bad = sorted(w for w in outputs if w % 16)
        if bad:
            raise ValueError(
                "quantization='int4' needs layer outputs that are multiples of 16; this "
                f"model has {', '.join(map(str, bad))}"
            )

    def load_quantizer(self):
        return filled_layer_quantizer(_quantized)

    def loaded_layer_bytes(self, out_features: int, in_features: int, bias: bool) -> int:
        # 4-bit codes, a bf16 scale and zero per group and output, a bf16 bias (Int4Linear)
        groups = in_features // GROUP_SIZE
        size = COMPUTE_DTYPE.itemsize
        return out_features * (in_features // 2 + 2 * groups * size + (size if bias else 0))

    def quantize(self, model, model_dir, *, dtype, measure_inputs, lm_head) -> int:
        total = sum(m.weight_bytes for m in model.modules() if isinstance(m, Int4Linear))
        # What the load left float (all of it, where it was not given load_quantizer),
        # popped one by one so that each float weight is freed as its layer is swapped.
        targets = quantized_targets(model)
        targets.reverse()
        while targets:
            parent, name, linear = targets.pop()
            layer = _quantized(linear)
            setattr(parent, name, layer)
            total += layer.weight_bytes
            del linear, layer
            return_freed_heap()
        # A mixture of experts' experts: the same groups of 32 (scale and minimum, in bf16)
        # in the native grouped kernel; activations stay in the model's dtype (quant's
        # check_expert_quantization has checked the kernel and the sizes).
        for experts in (m for m in model.modules() if isinstance(m, KernelExperts)):
            if not experts.pack(weight_format=self.expert_format):  # or the load did
                raise RuntimeError("the native grouped expert kernel refused int4 experts")
            total += experts.weight_bytes
        return total


def _quantized(linear: nn.Linear) -> Int4Linear:
    return Int4Linear.from_float(linear.weight, linear.bias, group_size=GROUP_SIZE)


register(Int4Method())
