"""The fp8 kernel's bf16 paths (fp8_bf16.h: codes decoded to bf16, vdpbf16ps below 3
rows, AMX tiles from 3) against its plain loops and a PyTorch dequantize-then-matmul,
for every scale layout, shapes no multiple of the tiles, one row and 37.

Tolerance: the e4m3 values are exact in bf16 and the inputs are bf16 already, so the
paths differ from the fp64 product of the dequantized weights only by the order of their
fp32 sums (at most (k + 2) * 2^-24 of the sum of |products| and |bias|) and the output's
one rounding to bf16 (half an ulp: 2^-8 of the value)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kernels import cpu_flags, native_library
from tokenmill.engine.kernels import fp8_linear as kernel

ALL_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
HAS_BF16 = "avx512_bf16" in cpu_flags()

# (n, k, block): per tensor, per channel, DeepSeek's 128 x 128 with ragged last blocks,
# 64 x 64 blocks ending mid-tile in both directions, and a block_k no multiple of 32
# (the plain loops take it).
LAYOUTS = {
    "tensor": (70, 300, (70, 300)),
    "channel": (100, 577, (1, 577)),
    "block-128": (200, 333, (128, 128)),
    "block-64-ragged": (97, 161, (64, 64)),
    "block-k-100": (50, 250, (32, 100)),
}


def _problem(n: int, k: int, block: tuple[int, int], rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = ALL_CODES[torch.randint(0, len(ALL_CODES), (n, k), generator=g)]
    grid = (-(-n // block[0]), -(-k // block[1]))
    scales = torch.rand(*grid, generator=g) * 0.01 + 0.001
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    return x, codes, scales, bias


def _reference(x, codes, scales, block, bias):
    """fp64 product of the dequantized weights, and the error bound the header states."""
    n, k = codes.shape
    weight = kernel.dequantize_rows(codes, scales, block, 0, n).double()
    want = torch.nn.functional.linear(x.double(), weight, bias.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), weight.abs(), bias.double().abs())
    bound = (k + 2) * 2.0**-24 * magnitude * (1 + 2.0**-8) + 2.0**-8 * want.abs()
    return want, bound


@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_paths_are_the_dequantized_product_within_bf16_rounding(layout, rows):
    n, k, block = LAYOUTS[layout]
    x, codes, scales, bias = _problem(n, k, block, rows, seed=rows + n)
    want, bound = _reference(x, codes, scales, block, bias)
    outputs = {
        isa: kernel.fp8_linear(x, codes, scales, block, bias, max_isa=isa)
        for isa in (None, "avx512_bf16", "generic")
    }
    for isa, y in outputs.items():
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        excess = (y.double() - want).abs() - bound
        assert excess.max() <= 0, f"{isa}: {excess.max()} past the bound"
    # the fast paths against the plain loops: both within the bound of the same product
    for isa in (None, "avx512_bf16"):
        apart = (outputs[isa].double() - outputs["generic"].double()).abs()
        assert (apart <= 2 * bound).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 37])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_where_every_sum_is_exact_the_paths_agree_to_the_bit(layout, rows):
    """Inputs of a few bits and power-of-two scales: every product and partial sum is
    exact in fp32, so any sum order gives the same value - a channel, row or block the
    fast paths read from the wrong place shows as a different bit."""
    n, k, block = LAYOUTS[layout]
    g = torch.Generator().manual_seed(7 * rows + k)
    # weights 1 .. 7.5 in steps of 1/8 at least, inputs k/4 up to 2, scales 1/4 .. 2: each
    # product a multiple of 2^-7 below 2^5, so sums of 577 need at most 22 bits
    small = torch.tensor([c for c in range(256) if 7 <= (c >> 3) & 15 <= 9], dtype=torch.uint8)
    codes = small[torch.randint(0, len(small), (n, k), generator=g)]
    grid = (-(-n // block[0]), -(-k // block[1]))
    scales = 2.0 ** torch.randint(-2, 2, grid, generator=g).float()
    x = (torch.randint(-8, 9, (rows, k), generator=g) / 4).to(torch.bfloat16)
    bias = torch.randint(-4, 5, (n,), generator=g).float()
    plain = kernel.fp8_linear(x, codes, scales, block, bias, max_isa="generic")
    weight = kernel.dequantize_rows(codes, scales, block, 0, n).double()
    exact = torch.nn.functional.linear(x.double(), weight, bias.double())
    assert torch.equal(plain, exact.to(torch.bfloat16))
    for isa in (None, "avx512_bf16"):
        assert torch.equal(kernel.fp8_linear(x, codes, scales, block, bias, max_isa=isa), plain)


def test_fp32_inputs_keep_the_plain_fp32_loops():
    """An fp32 model's product is the plain loops' fp32 one whatever the CPU has."""
    n, k, block = LAYOUTS["channel"]
    x, codes, scales, bias = _problem(n, k, block, 9, seed=11)
    x = x.float() + torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    best = kernel.fp8_linear(x, codes, scales, block, bias)
    assert best.dtype == torch.float32
    assert torch.equal(best, kernel.fp8_linear(x, codes, scales, block, bias, max_isa="generic"))


def test_the_path_is_reported_where_the_cpu_has_bf16_dot_products():
    native = native_library()
    assert native is not None
    isa = native.limits.fp8_linear_isa
    if HAS_BF16:
        assert isa in ("avx512_bf16", "amx_bf16+avx512_bf16")
        assert (isa == "amx_bf16+avx512_bf16") == native.limits.moe_isa.startswith("amx")
        assert f"{isa} for bf16 inputs" in kernel.kernel_name()
    else:
        assert isa in ("generic", "avx2", "avx512")
