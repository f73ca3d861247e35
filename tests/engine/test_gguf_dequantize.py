"""gguf_dequantize.c: GGUF Q4_0, Q4_1 and Q8_0 blocks decoded natively, bit for bit what
the gguf package's own dequantize gives - for any bytes, so every fp16 scale (subnormal,
infinite, NaN) and every code is met."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.engine.kernels import gguf_dequantize

pytestmark = pytest.mark.skipif(
    not gguf_dequantize.available(), reason="no C compiler: the native kernels are not built"
)


@pytest.mark.parametrize("kind", list(gguf_dequantize.KINDS))
def test_random_blocks_decode_to_ggufs_own_values(kind):
    _, nbytes = gguf_dequantize.KINDS[kind]
    rows, blocks_per_row = 64, 8
    generator = np.random.default_rng(0)
    raw = generator.integers(0, 256, (rows, blocks_per_row * nbytes), dtype=np.uint8)
    # Scales that are exactly 1.0, a subnormal, zero, -infinity and a NaN in fp16.
    for block, scale in enumerate([0x3C00, 0x0001, 0x0000, 0xFC00, 0x7E01]):
        raw[0, block * nbytes : block * nbytes + 2] = [scale & 0xFF, scale >> 8]
    with np.errstate(invalid="ignore", over="ignore"):  # the NaN and infinite scales
        want = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)
    got = gguf_dequantize.dequantize_blocks(torch.from_numpy(raw), kind).numpy()
    assert got.shape == want.shape == (rows, blocks_per_row * 32)
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 18 bytes"):
        gguf_dequantize.dequantize_blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_0")
