"""A RowWeight packed slice by slice (quant/packed_linear.py's pack_rows): the same bytes
as oneDNN's pack of the whole weight, and pack_linear_layers' handling of it."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from tokenmill.engine.quant import packed_linear
from tokenmill.engine.quant.packed_linear import (
    PackedLinear,
    RowWeight,
    pack_linear_layers,
    pack_rows,
    packs_dtype,
)
from tokenmill.engine.types.config import cpu_has_fast_bf16


class DenseRows(RowWeight):
    """A RowWeight over a dense tensor, counting the rows it hands out."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_ = weight
        self.read: list[tuple[int, int]] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        self.read.append((start, stop))
        return self.weight_[start:stop].clone()


def _packs_row_blocks(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` here as whole output blocks in row order, the layout
    pack_rows copies slices into: fp32 on every CPU, bf16 where the CPU multiplies bf16
    natively. Where bf16 is emulated (AVX-512 without AVX512-BF16) oneDNN packs it in
    another layout, and pack_rows must say None (the caller packs the whole weight)."""
    return dtype == torch.float32 or cpu_has_fast_bf16()


def _bytes(packed: torch.Tensor) -> bytes:
    ops = torch.ops.mkldnn
    return ctypes.string_at(ops.data_ptr(packed), ops._nbytes(packed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_from_slices_is_the_whole_weights_pack_byte_for_byte(monkeypatch, dtype):
    if not packs_dtype(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    monkeypatch.setattr(packed_linear, "SLICE_ROWS", 128)
    weight = torch.randn(128 * 3 + 64, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    source = DenseRows(weight)
    packed = pack_rows(source)
    if not _packs_row_blocks(dtype):
        assert packed is None
        return
    assert packed is not None
    assert source.read == [(0, 128), (128, 256), (256, 384), (384, 448)]
    whole = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    assert _bytes(packed) == _bytes(whole)


@pytest.mark.parametrize("rows", [128 + 9, 265, 40])
def test_a_last_slice_of_part_blocks_packs_as_the_whole_matrix_pads_it(monkeypatch, rows):
    dtype = torch.bfloat16
    if not packs_dtype(dtype):
        pytest.skip("oneDNN does not pack bf16 on this CPU")
    monkeypatch.setattr(packed_linear, "SLICE_ROWS", 128)
    weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    packed = pack_rows(DenseRows(weight))
    if not _packs_row_blocks(dtype) and rows > 128:  # one slice is the whole matrix's pack
        assert packed is None
        return
    assert packed is not None
    assert _bytes(packed) == _bytes(torch.ops.mkldnn._reorder_linear_weight(weight, None))


def test_pack_linear_layers_packs_a_row_weight_or_builds_its_linear(monkeypatch):
    dtype = torch.bfloat16 if packs_dtype(torch.bfloat16) else torch.float32
    monkeypatch.setattr(packed_linear, "SLICE_ROWS", 128)
    weight = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = torch.nn.functional.linear(x, weight)

    model = nn.Sequential(DenseRows(weight))
    pack_linear_layers(model, dtype=dtype, device=torch.device("cpu"))
    if packs_dtype(dtype):
        assert isinstance(model[0], PackedLinear)
        torch.testing.assert_close(model[0](x).float(), want.float(), rtol=2e-2, atol=2e-2)
        assert _bytes(model[0].packed_weight) == _bytes(
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
        )

    off = nn.Sequential(DenseRows(weight))
    assert pack_linear_layers(off, dtype=dtype, device=torch.device("cpu"), enabled=False) == 0
    assert type(off[0]) is nn.Linear
    assert torch.equal(off[0].weight, weight)
    assert torch.equal(off[0](x), want)


def test_a_row_weight_refuses_a_forward():
    with pytest.raises(RuntimeError, match="packed or built as nn.Linear"):
        DenseRows(torch.zeros(64, 64))(torch.zeros(1, 64))
