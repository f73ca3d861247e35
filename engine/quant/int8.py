"""int8 linear layers: per-channel int8 weights x dynamically quantized int8 activations.

Each output channel's weights are rounded to int8 with their own scale (max|w| / 127);
at run time each row (token) of the layer's input is quantized to uint8 with its own
scale (kernels/quantize.c; one scale for the whole tensor lost up to 20% of a layer's
output on SmolLM2's outlier activations, per row 2-4%), and the product runs on one of
two kernels, each a layer class, chosen per layer at load (`Int8Linear.from_float`):

- "native" (`NativeInt8Linear`): our kernel (kernels/int8_linear.c), where the library
  was built for a CPU with AVX512-VNNI or AVX2 and the layer's shape fits its panels; on
  CPUs with AMX it runs calls of 8 rows or more on the tile units (kernels/int8_amx.h),
  on the same packed weights, and on AVX2-only CPUs it multiplies signed pairs
  (kernels/int8_avx2.h; 256-bit vpdpbusd where the CPU has AVX-VNNI). It quantizes the
  rows to 8 bits and applies each row's scale in its epilogue in the same call, takes any
  row count, and gives the same bits on every instruction set; a gated MLP's gate_up
  also applies the activation and the multiply by up there (`fused_activation` below).
  Why ours and not oneDNN's: docs/design.md, "Our own int8 kernel" and "int8 on
  AMX tiles". On AVX2 it is the only int8 path that keeps 8-bit activations (below).
- "onednn" (`OneDNNInt8Linear`): oneDNN's int8 matmul
  (`torch.ops.onednn.qlinear_pointwise`, the op PyTorch's PT2E quantization lowers to) on
  a weight packed once at load, where ours is not built. oneDNN picks its kernel for the
  CPU at run time: AVX512-VNNI, AVX-VNNI, else AVX2's vpmaddubsw multiply-add (AMX too,
  on a build of ours without it); ONEDNN_MAX_CPU_ISA caps it (tests use that to run the
  fallback). Without VNNI or AMX the u8 x s8 pairs are summed in int16 and saturate, so
  activations there use 7 bits, which miss the 2% the int8 mode promises
  (docs/design.md, "int8 on AVX2: all 8 bits"); AVX2 builds therefore run the
  native kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from tokenmill.engine.kernels import cpu_flags
from tokenmill.engine.kernels import int8_linear as native
from tokenmill.engine.kernels.quantize import (
    FULL_RANGE,
    REDUCED_RANGE,
    ROUNDINGS,
    quantize_rows_u8,
)
from tokenmill.engine.loader.heap import return_freed_heap
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.models.layers import GatedMLP
from tokenmill.engine.models.moe import KernelExperts
from tokenmill.engine.quant.calibrate import (
    ROWS_PER_CHUNK,
    absmax,
    calibration_token_ids,
    smoothing_factors,
)
from tokenmill.engine.quant.method import QuantizationMethod, quantized_targets, register

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernel takes as it is


def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear ops."""
    ops = torch.ops.onednn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "qlinear_prepack")
        and hasattr(ops, "qlinear_pointwise")
    )


def kernel_name() -> str | None:
    """The integer dot-product instructions oneDNN's int8 kernels use on this CPU, by its
    flags and ONEDNN_MAX_CPU_ISA (None when the int8 ops are missing)."""
    if not onednn_int8_available():
        return None
    flags = cpu_flags()
    ladder = [  # oneDNN's ISA names, best first, with the CPU flag each needs
        ("avx512_core_amx", "amx_int8"),
        ("avx512_core_vnni", "avx512_vnni"),
        ("avx2_vnni", "avx_vnni"),
        ("avx2", "avx2"),
    ]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()
    names = [name for name, _ in ladder]
    start = names.index(cap) if cap in names else 0
    for name, flag in ladder[start:]:
        if flag in flags:
            return name
    return "sse41"


def choose_kernel(out_features: int, in_features: int) -> str:
    """The int8 kernel a layer of this shape runs on here: "native" where our kernel is
    built (AVX512-VNNI, with AMX tiles for larger row counts where the CPU has them, or
    AVX2) and takes the shape, else "onednn". Why native on AMX and AVX2:
    docs/design.md, "int8 on AMX tiles" and "int8 on AVX2: all 8 bits"."""
    if native.takes_shape(out_features, in_features):
        return NativeInt8Linear.kernel
    return OneDNNInt8Linear.kernel


def describe_kernel(kernel: str) -> str:
    """A kernel choice in words, with the instructions it runs on."""
    return _layer_class(kernel).describe()


def has_int8_dot_products() -> bool:
    """Whether oneDNN's int8 kernels here accumulate u8 x s8 products without int16
    saturation (VNNI or AMX); otherwise activations use 7 bits (see kernels/quantize.py)."""
    return kernel_name() in ("avx512_core_amx", "avx512_core_vnni", "avx2_vnni")


def padded_rows(num_rows: int) -> int:
    """The row count an int8 product runs at: up to 32 rows the next power of two (at
    least 8), above it the next multiple of 64.

    oneDNN builds (JIT-compiles) a kernel for every new input shape, at tens to hundreds
    of milliseconds a shape (docs/design.md, "Our own int8 kernel"), and a step's row
    count changes nearly every step; padding to a few dozen sizes lets the kernels be
    reused, at the price of at most 63 rows of zeros on a long chunk.
    """
    if num_rows <= 32:
        return max(8, 1 << (num_rows - 1).bit_length())
    return -(-num_rows // 64) * 64


def quantize_weight(
    weight: torch.Tensor, smooth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N]) with weight * smooth[None, :] ~
    int8 * scale[:, None]. Rows are independent, so a large weight (an lm_head) is
    quantized a chunk of rows at a time, never through a whole fp32 copy."""
    qweight = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0])
    start = 0
    for rows in weight.detach().split(ROWS_PER_CHUNK):
        # One fp32 copy of the chunk, worked on in place (an fp32 weight copied too).
        rows = rows.to(torch.float32, copy=True)
        if smooth is not None:
            rows.mul_(smooth.float()[None, :])
        row_absmax = absmax(rows, dim=1)
        chunk_scale = torch.where(row_absmax > 0, row_absmax / 127, torch.ones_like(row_absmax))
        stop = start + rows.shape[0]
        # |rows / scale| <= 127 by the scale's choice: rounding needs no clamp.
        qweight[start:stop] = rows.div_(chunk_scale[:, None]).round_()
        scale[start:stop] = chunk_scale
        start = stop
    return qweight, scale


class Int8Linear(nn.Module):
    """nn.Linear's forward with int8 weights and activations; output in the input's dtype.

    Each kernel is a subclass (`NativeInt8Linear`, `OneDNNInt8Linear`), chosen once when
    a layer is built (`from_float`); its `kernel` names it.

    With smoothing factors s [in_features] (calibrate.py) the stored weight is
    W * s[None, :] and the input is divided by s inside the quantizer.

    A gated MLP's gate_up layer built with `gated_activation` (where the native kernel
    takes it: native.takes_gated) also computes act(gate) * up in the product's epilogue:
    `layer(x, activation=...)` returns that, [rows, out_features / 2], and the layer's
    `fused_activation` says which activation it takes (None: none). Its plain forward
    still returns [gate, up].
    """

    kernel: ClassVar[str]

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        smooth: torch.Tensor | None = None,
        rounding: str = "symmetric",
    ) -> None:
        super().__init__()
        if rounding not in ROUNDINGS:
            raise ValueError(f"unknown activation rounding {rounding!r}; choose from {ROUNDINGS}")
        self.rounding = rounding  # how each row of the input is quantized (quantize.py)
        self.out_features, self.in_features = qweight.shape
        inv_smooth = None if smooth is None else (1.0 / smooth.float()).contiguous()
        self.register_buffer("inv_smooth", inv_smooth, persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.weight_bytes = qweight.numel() + 4 * scale.numel()
        self.fused_activation: str | None = None

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        smooth: torch.Tensor | None = None,
        kernel: str | None = None,
        gated_activation: str | None = None,
    ) -> Int8Linear:
        """Quantize a float weight [out, in], optionally smoothed by s [in], into the layer
        class of `kernel` ("native" or "onednn"; None takes choose_kernel's).
        gated_activation: the MLP's activation, for a [gate; up] weight (fused where the
        native kernel can)."""
        layer_class = _layer_class(kernel or choose_kernel(*weight.shape))
        qweight, scale = quantize_weight(weight, smooth)
        return layer_class(qweight, scale, bias, smooth, gated_activation=gated_activation)

    @classmethod
    def describe(cls) -> str:
        """The kernel in words, with the instructions it runs on here."""
        raise NotImplementedError

    def _check_activation(self, activation: str | None) -> None:
        if activation is not None and activation != self.fused_activation:
            raise ValueError(f"this int8 layer fuses {self.fused_activation!r}, not {activation!r}")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 {self.kernel}"
        )


class NativeInt8Linear(Int8Linear):
    """Our kernel (kernels/int8_linear.c): quantizes the rows and applies their scales in
    the same call, takes any row count, all 8 bits on every instruction set it has."""

    kernel = "native"

    def __init__(
        self, qweight, scale, bias, smooth=None, *, gated_activation=None, rounding="symmetric"
    ) -> None:
        if not native.takes_shape(*qweight.shape):
            raise ValueError(
                f"the native int8 kernel does not take a {tuple(qweight.shape)} weight here"
            )
        if rounding == "full" and not native.takes_full_rounding():
            raise ValueError(
                f"the native int8 kernel on {native.native_int8_isa()} does not take codes "
                "down to -128 (the full rounding)"
            )
        super().__init__(qweight, scale, bias, smooth, rounding)
        self.value_range = native.VALUE_RANGE
        if gated_activation in native.GATED_ACTIVATIONS and native.takes_gated(*qweight.shape):
            self.fused_activation = gated_activation
        gated = self.fused_activation is not None
        self.packed = native.pack_int8_weight(qweight, self.scale, self.bias, gated=gated)

    @classmethod
    def describe(cls) -> str:
        return f"native {native.native_int8_isa()}, 8-bit activations"

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]; with `activation` (only the
        layer's fused_activation) act(gate) * up, [..., out_features / 2]."""
        self._check_activation(activation)
        # Channels in the packed gate/up order, unless the activation consumes them.
        interleaved = self.fused_activation is not None and activation is None
        if not interleaved and x.dim() == 2 and x.dtype in _NATIVE_DTYPES:
            # The engine's case, every call of a step: no reshapes or casts, each of which
            # costs microseconds of dispatch on calls that take tens.
            return native.int8_linear(
                x, self.packed, self.inv_smooth, activation=activation, rounding=self.rounding
            )
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        dtype = x.dtype if x.dtype in _NATIVE_DTYPES else torch.float32
        y = native.int8_linear(
            rows.to(dtype),
            self.packed,
            self.inv_smooth,
            activation=activation,
            rounding=self.rounding,
        ).to(x.dtype)
        if interleaved:  # back to [gate, up]
            pairs = self.out_features // (2 * native.PANEL)
            y = y.view(-1, pairs, 2, native.PANEL).transpose(1, 2)
        width = self.out_features // 2 if activation is not None else self.out_features
        return y.reshape(*shape[:-1], width)


class OneDNNInt8Linear(Int8Linear):
    """oneDNN's int8 matmul on a weight packed once at load (see the module docstring);
    it fuses no activation."""

    kernel = "onednn"

    def __init__(
        self, qweight, scale, bias, smooth=None, *, gated_activation=None, rounding="symmetric"
    ) -> None:
        super().__init__(qweight, scale, bias, smooth, rounding)
        self.register_buffer(
            "packed_weight", torch.ops.onednn.qlinear_prepack(qweight, None), persistent=False
        )
        self.register_buffer(
            "zero_points", torch.zeros(self.out_features, dtype=torch.int64), persistent=False
        )
        self.value_range = FULL_RANGE if has_int8_dot_products() else REDUCED_RANGE

    @classmethod
    def describe(cls) -> str:
        bits = 8 if has_int8_dot_products() else 7
        return f"oneDNN {kernel_name()}, {bits}-bit activations"

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        self._check_activation(activation)
        shape = x.shape
        y = self._product(x.reshape(-1, self.in_features), x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        qx, x_scales = quantize_rows_u8(x, self.inv_smooth, self.value_range, self.rounding)
        num_rows = qx.shape[0]
        padded = padded_rows(num_rows)
        if padded != num_rows:  # rows of zero point: they compute zeros, then are dropped
            filler = qx.new_full((padded - num_rows, self.in_features), self.value_range[1])
            qx = torch.cat([qx, filler])
        # oneDNN takes one activation scale per tensor: run it at scale 1 and apply each
        # row's own scale to the row's outputs (bias added after, at full scale).
        y = torch.ops.onednn.qlinear_pointwise(
            qx,
            1.0,
            self.value_range[1],
            self.packed_weight,
            self.scale,
            self.zero_points,
            None,
            1.0,
            0,
            dtype,
            "none",
            [],
            "",
        )
        y = y[:num_rows].mul_(x_scales.to(y.dtype)[:, None])
        if self.bias is not None:
            y.add_(self.bias)
        return y


# The int8 kernels by name, each a layer class.
INT8_KERNELS: dict[str, type[Int8Linear]] = {
    cls.kernel: cls for cls in (NativeInt8Linear, OneDNNInt8Linear)
}
KERNELS = tuple(INT8_KERNELS)


def _layer_class(kernel: str) -> type[Int8Linear]:
    if kernel not in INT8_KERNELS:
        raise ValueError(f"unknown int8 kernel {kernel!r}; choose one of {KERNELS}")
    return INT8_KERNELS[kernel]


class Int8Method(QuantizationMethod):
    """Per-channel int8 weights, dynamically quantized int8 activations, smoothed
    SmoothQuant-style with statistics from one float pass at load (calibrate.py)."""

    name = "int8"
    help = "int8 weights and activations"
    layer_classes = (Int8Linear,)
    expert_format = "int8"
    # A one-sequence decode step reads the lm_head as a quarter of the decoder's
    # weights again (SmolLM2: 57 MB beside 212 MB in bf16); smoothed, int8 costs it about
    # +0.5% perplexity (docs/design.md, "The lm_head in int8 is a setting").
    quantizes_lm_head = True

    def check(self, model_dir: Path, config: ModelConfig, device: torch.device) -> None:
        super().check(model_dir, config, device)
        if not onednn_int8_available():
            raise ValueError("quantization='int8' needs a torch build with oneDNN's int8 ops")

    def held_layer_bytes(self) -> Callable[[int, int, bool], int]:
        return held_int8_bytes

    def held_head_bytes(self) -> Callable[[int, int, bool], int]:
        return held_int8_bytes

    def quantize(self, model, model_dir, *, dtype, measure_inputs, lm_head) -> int:
        targets = quantized_targets(model)
        if lm_head:
            targets.append((model, "lm_head", model.lm_head))
        layers = [linear for _, _, linear in targets]
        token_ids = calibration_token_ids(model_dir, model.config.vocab_size)
        # A mixture of experts' experts are int8 already here (the load packed each layer
        # as it filled: `expert_format`), so this pass measures each dense layer's inputs
        # downstream of int8 experts: the inputs it will see when the quantized model
        # runs, which is what its smoothing is for (and the float experts of every layer
        # at once would not fit where the quantized model is meant to).
        x_absmax = measure_inputs(model, layers, token_ids)
        del layers
        total = 0
        # Popped one by one, as are their statistics (keyed by the layer): once swapped,
        # a float layer is referenced nowhere and its weight is freed (a mapped one
        # unmapped) before the next is quantized - not all at the loop's end.
        targets.reverse()
        while targets:
            parent, name, linear = targets.pop()
            # A gated MLP's gate_up takes its activation into the product where it can.
            gated = isinstance(parent, GatedMLP) and name == "gate_up_proj"
            layer = _smoothed(linear, x_absmax.pop(linear), parent.activation if gated else None)
            setattr(parent, name, layer)
            total += layer.weight_bytes
            del linear, layer
            # The float weight and the fp32 temporaries are free now, but the engine's
            # malloc settings (worker/host_memory.py) keep freed blocks in the heap, where
            # a whole model's worth would stay resident for the process's life.
            return_freed_heap()
        # A mixture of experts' experts: int8 weights, a scale per output column, for the
        # native grouped kernel; their activations stay in the model's dtype (quant's
        # check_expert_quantization has checked that the kernel runs here). Packed by
        # the load already, where it was given expert_packer; else here.
        for experts in (m for m in model.modules() if isinstance(m, KernelExperts)):
            if not experts.pack(weight_format=self.expert_format):
                raise RuntimeError("the native grouped expert kernel refused int8 experts")
            total += experts.weight_bytes
        return total


def held_int8_bytes(out_features: int, in_features: int, bias: bool) -> int:
    """The bytes an Int8Linear [out, in] holds, for the memory plan: its int8 codes, an
    fp32 scale per output row, an fp32 inverse smoothing factor per input and an fp32
    bias (the kernels' own copies of the per-row vectors - a few bytes per row - aside)."""
    return out_features * in_features + 4 * out_features * (1 + bias) + 4 * in_features


def quantize_lm_head(model, model_dir: Path, measure_inputs) -> int:
    """Swap `model.lm_head` for an Int8Linear smoothed from one calibration pass over the
    model as it stands (its decoder layers may be another mode's already: gguf's);
    returns the new layer's weight bytes."""
    if not onednn_int8_available():
        raise ValueError("quantize_lm_head=True needs a torch build with oneDNN's int8 ops")
    head = model.lm_head
    token_ids = calibration_token_ids(model_dir, model.config.vocab_size)
    layer = _smoothed(head, measure_inputs(model, [head], token_ids)[head])
    model.lm_head = layer
    return layer.weight_bytes


def _smoothed(linear: nn.Linear, x_absmax: torch.Tensor, gated_activation=None) -> Int8Linear:
    """`linear` in int8, smoothed by its input statistics from the calibration pass."""
    return Int8Linear.from_float(
        linear.weight,
        linear.bias,
        smoothing_factors(x_absmax, linear.weight),
        gated_activation=gated_activation,
    )


register(Int8Method())
