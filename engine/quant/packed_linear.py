"""CPU linear layers through oneDNN, each weight packed once at load.

`F.linear` on CPU goes to MKL, which on AMD processors reaches about half of what the
hardware does (it does not pick its AVX-512 kernels there, by all appearances). oneDNN
on a weight packed once into its blocked layout avoids that, and the per-call repack
MKL-DNN does on decode batches; results are fp32 to rounding. Why and by how much:
docs/design.md, "oneDNN-packed linear layers".

`pack_linear_layers` swaps every nn.Linear of a loaded model for a PackedLinear. It
also packs a RowWeight (a layer whose weight comes a slice of rows at a time: the `gguf`
mode's lm_head in its blocks) slice by slice into the packed buffer, so that the whole
float weight and its packed copy are never in memory together (`pack_rows`). It
runs only on CPU for fp32, and bf16 where the CPU has oneDNN's bf16 reorder
(`packs_dtype`), only when this torch build has the oneDNN ops, and only after one
packed projection has matched F.linear on random input; otherwise the model
is left as it was. The packed_linear setting (EngineConfig) False keeps F.linear.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import packed_matvec
from tokenmill.engine.kernels.packed_matvec import PackedMatvec
from tokenmill.engine.types.config import onednn_has_bf16

log = logging.getLogger(__name__)


def onednn_linear_available() -> bool:
    """Whether this torch build can pack a linear weight for oneDNN on CPU."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU: fp32 wherever torch has the
    ops; bf16 only where oneDNN's bf16 reorder runs (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or
    AMX - the check torch itself makes). An AVX2-only CPU such as AMD Zen 1 keeps
    F.linear for bf16 weights."""
    if not onednn_linear_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_has_bf16())


# Rows decoded and packed at a time by pack_rows: a multiple of every output block width
# oneDNN packs bf16 in (packed_matvec.BLOCK_COLS), small beside an 8B head (128,256 rows).
SLICE_ROWS = 4096


class RowWeight(nn.Module):
    """A linear layer whose weight is read a slice of output rows at a time (`rows`), never
    held whole: pack_linear_layers packs it slice by slice, or builds its nn.Linear
    (`to_linear`) where it does not pack."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The weight's rows [start, stop), [stop - start, in_features] in `dtype`."""
        raise NotImplementedError

    def to_linear(self) -> nn.Linear:
        """The layer as nn.Linear, its whole weight read."""
        # On the meta device: no random initialisation of a matrix about to be replaced.
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(self.rows(0, self.out_features), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=False)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a RowWeight is packed or built as nn.Linear before it is used")


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight held in oneDNN's blocked layout.

    A bf16 layer called with one row (one-sequence decode) goes to the native matvec,
    which reads the same packed weight faster than oneDNN's matmul does at one row
    (docs/design.md, "One-row linear layers"), where the layout is one it reads;
    `one_row_block_cols` finds out, per layer.
    """

    def __init__(self, linear: nn.Linear | RowWeight, packed: torch.Tensor | None = None) -> None:
        """linear's weight packed here, or `packed` (what pack_rows built from a
        RowWeight) taken as it is."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if packed is None:
            weight = linear.weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            dtype = weight.dtype
        else:
            dtype = linear.dtype
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.one_row: PackedMatvec | None = None
        if dtype == torch.bfloat16 and packed_matvec.vectorized():
            block_cols = one_row_block_cols(self)
            if block_cols is not None:
                self.one_row = self._matvec(block_cols)

    def _matvec(self, block_cols: int) -> PackedMatvec:
        bias = None if self.bias is None else self.bias.contiguous()
        return PackedMatvec(
            self.packed_weight, self.in_features, self.out_features, block_cols, bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one_row = self.one_row
        if (
            one_row is not None
            and x.numel() == self.in_features
            and x.dtype == torch.bfloat16
            and one_row.weight is self.packed_weight
        ):
            return one_row(x.contiguous())
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def one_row_block_cols(packed: PackedLinear) -> int | None:
    """The output block width with which the native matvec reads this layer's packed bf16
    weight as oneDNN computes with it, or None where no width does.

    oneDNN's packed layout is its own to choose (by CPU, shape and version); the widths
    the kernel reads are tried in turn, each checked against oneDNN's product of the same
    weight on random rows. A wrong layout gives unrelated sums, so agreement to bf16
    rounding settles it.
    """
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 1, packed.in_features, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        want = [
            torch.ops.mkldnn._linear_pointwise(
                row, packed.packed_weight, packed.bias, "none", [], ""
            ).float()
            for row in rows
        ]
        for block_cols in packed_matvec.BLOCK_COLS:
            try:
                call = packed._matvec(block_cols)
            except ValueError:
                continue  # this width does not tile the layer, or the sizes differ
            if all(_close(call(row).float(), ref, torch.bfloat16) for row, ref in zip(rows, want)):
                return block_cols
    return None


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal to `dtype`'s rounding: two products summed in different orders."""
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def _row_slices(rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, rows, SLICE_ROWS):
        yield start, min(start + SLICE_ROWS, rows)


def _zero_pages(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in pages the kernel maps only when written: numpy's calloc of a large array
    is fresh anonymous memory, which reads as the one shared zero page and adds nothing
    to the resident set (torch.zeros writes every page)."""
    storage = np.float32 if dtype == torch.float32 else np.int16
    return torch.from_numpy(np.zeros(shape, dtype=storage)).view(dtype)


def pack_rows(source: RowWeight) -> torch.Tensor | None:
    """source's weight packed for oneDNN without the whole float weight: oneDNN packs a
    zero weight of the full shape (its layout, its buffer; the zeros cost no memory), and
    each slice of SLICE_ROWS rows, read and packed on its own, is copied over its rows.

    That holds where a slice's packed bytes are the same rows' bytes of the whole
    matrix's: a layout of whole output blocks in row order (kernels.h, packed_matvec),
    which slices that are multiples of the block width keep. It is checked, not assumed:
    each slice's packed size must be its rows' (the last one's: the rest of the
    buffer, padded to a whole block as the matrix's last block is), and the packed product of random rows
    must match F.linear over the slices as they were read. None where either fails (the
    caller packs the whole weight as before).
    """
    rows, cols, dtype = source.out_features, source.in_features, source.dtype
    itemsize = torch.empty(0, dtype=dtype).element_size()
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    packed = ops._reorder_linear_weight(_zero_pages((rows, cols), dtype), None)
    total = ops._nbytes(packed)
    base = ops.data_ptr(packed)
    probe = torch.randn(2, cols, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = []
    for start, stop in _row_slices(rows):
        weight = source.rows(start, stop)
        want.append(F.linear(probe, weight).float())
        part = ops._reorder_linear_weight(weight, None)
        offset, size = start * cols * itemsize, ops._nbytes(part)
        # Whole slices fill their rows exactly; the last one, padded to a whole output
        # block as the full matrix's last block is, ends where the buffer does.
        if size != (stop - start) * cols * itemsize if stop < rows else offset + size != total:
            return None
        ctypes.memmove(base + offset, ops.data_ptr(part), size)
        del weight, part
    got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    if not _close(got.float(), torch.cat(want, dim=1), dtype):
        log.warning("oneDNN packs a slice of rows in another layout; packing the whole weight")
        return None
    return packed


def _pack_row_weight(source: RowWeight) -> nn.Module:
    """source as a PackedLinear, from slices where pack_rows can, else from its whole
    weight; as nn.Linear where oneDNN fails here."""
    try:
        packed = pack_rows(source)
        if packed is not None:
            return PackedLinear(source, packed)
        linear = source.to_linear()
        packed_linear = PackedLinear(linear)
        return packed_linear if _agrees(linear, packed_linear) else linear
    except RuntimeError as exc:
        log.warning("oneDNN linear unavailable (%s); keeping F.linear", exc)
        return source.to_linear()


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    """The packed layer computes what F.linear computes, to the dtype's rounding."""
    weight = linear.weight.detach()
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(weight.dtype)
    bias = None if linear.bias is None else linear.bias.detach()
    want = F.linear(x, weight, bias).float()
    return _close(packed(x).float(), want, weight.dtype)


def pack_linear_layers(
    model: nn.Module, *, dtype: torch.dtype, device: torch.device, enabled: bool = True
) -> int:
    """Replace model's nn.Linear layers by PackedLinear ones, in place (when enabled), and
    its RowWeights too (packed from slices); a RowWeight left unpacked becomes nn.Linear.

    Returns:
        How many nn.Linear layers were replaced (0 when packing does not apply here).
    """
    packs = enabled and device.type == "cpu" and packs_dtype(dtype)
    sources = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, RowWeight)
    ]
    for parent, name in sources:
        source = getattr(parent, name)
        built = _pack_row_weight(source) if packs else source.to_linear().to(device)
        setattr(parent, name, built)
        del source, built
    if not packs:
        return 0
    # (parent, attribute) only: holding the layers themselves would keep every unpacked
    # weight alive until the last one is packed - the model's size again at peak.
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if not targets:
        return 0
    try:
        first = PackedLinear(getattr(*targets[0]))
        if not _agrees(getattr(*targets[0]), first):
            log.warning("oneDNN linear disagrees with F.linear here; keeping F.linear")
            return 0
    except RuntimeError as exc:
        log.warning("oneDNN linear unavailable (%s); keeping F.linear", exc)
        return 0
    setattr(*targets[0], first)  # already packed for the check
    for parent, name in targets[1:]:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)
