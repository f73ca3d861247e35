"""gguf_dequantize.c: GGUF Q4_0, Q4_1 and Q8_0 blocks decoded natively, bit for bit what
the gguf package's own dequantize gives - for any bytes, so every fp16 scale (subnormal,
infinite, NaN) and every code is met; and 4-bit rows moved into the native 4-bit
product's layout as its packing of their decoded values writes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.engine.kernels import gguf_dequantize, q4_linear
from tokenmill.engine.loader import gguf_blocks
from tokenmill.engine.quant.gguf_linear import as_int4

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


@pytest.mark.parametrize("kind", list(gguf_dequantize.KINDS))
def test_blocks_decode_straight_to_the_bf16_bits_of_their_fp32_values(kind):
    """The bf16 output is torch's rounding of the fp32 decode, bit for bit: random
    scales round up, down and to even; the infinite scale stays infinite and the NaN
    scale gives torch's NaN."""
    _, nbytes = gguf_dequantize.KINDS[kind]
    generator = np.random.default_rng(1)
    raw = generator.integers(0, 256, (48, 6 * nbytes), dtype=np.uint8)
    for block, scale in enumerate([0x3C00, 0x0001, 0x0000, 0xFC00, 0x7E01]):
        raw[0, block * nbytes : block * nbytes + 2] = [scale & 0xFF, scale >> 8]
    blocks = torch.from_numpy(raw)
    want = gguf_dequantize.dequantize_blocks(blocks, kind).to(torch.bfloat16)
    got = gguf_dequantize.dequantize_blocks(blocks, kind, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (48, 6 * 32)
    nan = want.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    # Not all of them were exact in bf16: the rounding itself was checked.
    assert (want[~nan].float() != gguf_dequantize.dequantize_blocks(blocks, kind)[~nan]).any()
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        gguf_dequantize.dequantize_blocks(blocks, kind, torch.float16)


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 18 bytes"):
        gguf_dequantize.dequantize_blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_0")


@pytest.mark.parametrize(("kind", "affine"), [("Q4_0", False), ("Q4_1", True)])
def test_gguf_4bit_rows_pack_to_the_bytes_of_their_decoded_weights(kind, affine):
    """tm_q4_pack_gguf moves codes and fp16 scales as they are: the bytes pack_q4_weight
    writes from the decoded codes, scales and minimums (the gguf mode's other path)."""
    _, nbytes = gguf_dequantize.KINDS[kind]
    raw = np.random.default_rng(1).integers(0, 256, (64, 4 * nbytes), dtype=np.uint8)
    for block in range(4):  # finite fp16 scales and minimums, as decoding needs
        raw[:, block * nbytes + 1] &= 0x7B
        raw[:, block * nbytes + 3] &= 0x7B
    raw = torch.from_numpy(raw)
    bias = torch.randn(64)
    q, scale, minimum = as_int4(gguf_blocks.decode(raw, kind), kind)
    want = q4_linear.pack_q4_weight(q, scale, minimum if affine else None, bias)
    got = q4_linear.pack_gguf_q4_weight(raw, affine, bias)
    assert torch.equal(got.blocks, want.blocks)
    assert torch.equal(got.bias, want.bias)
    assert (got.affine, got.out_features, got.in_features) == (affine, 64, 128)
