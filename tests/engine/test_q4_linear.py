"""The native 4-bit GGUF linear (kernels/q4_linear.c): it quantizes each block of 32 inputs
as its contract says, its product equals the block-wise integer product at every tile
edge on each instruction set it is built for (AVX512-VNNI, AVX-VNNI, AVX2) with the same
bits on all of them, its bf16 expansion is exact, and the gguf layers take it only where
the library has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.kernels import cpu_flags
from tokenmill.engine.kernels.q4_linear import (
    native_q4_isa,
    pack_q4_weight,
    q4_linear,
    unpack_q4_bf16,
)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract's activation quantization in PyTorch: (qx int8, scales, sums)."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    amax = blocks.abs().amax(-1)
    # A tensor over a tensor: `127.0 / amax` runs as 127 * (1 / amax) in PyTorch, one more
    # rounding than the contract's single division, which moves ties (x * inv = n + 0.5).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (blocks * inv[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(rows, k), amax / 127.0, q.sum(-1).int()


def reference(qx, x_scales, x_sums, q, scale, minimum, bias) -> torch.Tensor:
    """The product in float64 from the exact block sums."""
    rows, k = qx.shape
    n, nb = q.shape[0], k // 32
    isum = torch.einsum(
        "rbj,nbj->rnb", qx.double().reshape(rows, nb, 32), q.double().reshape(n, nb, 32)
    )
    mins = -8 * scale.double() if minimum is None else minimum.double()
    terms = scale.double()[None] * isum + mins[None] * x_sums.double()[:, None, :]
    out = (x_scales.double()[:, None, :] * terms).sum(-1)
    return out if bias is None else out + bias.double()


def random_blocks(n: int, k: int, affine: bool, seed: int):
    """q in 0..15 (the extremes in the first and last rows), fp16 scales and minimums."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[0], q[-1] = 15, 0
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    minimum = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float() if affine else None
    return q, scale, minimum


@pytest.fixture
def needs_native(cpu_path):
    isa = native_q4_isa()
    cpu_path("4-bit GGUF linear, native kernel", isa or "not built for this CPU (int4 instead)")
    return isa


# Shapes cover every register tile edge: AVX-512's 1-4 rows and one or two panels, AVX2's
# 1-2 rows, 96-row blocks; k of one block to the model's down projection.
@pytest.mark.parametrize(
    "n,k", [(16, 32), (48, 64), (80, 96), (960, 576), (576, 1536), (3072, 576)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 95, 97, 200])
@pytest.mark.parametrize("affine", [False, True])
def test_the_product_equals_the_block_product(n, k, rows, affine, needs_native):
    if needs_native is None:
        return
    q, scale, minimum = random_blocks(n, k, affine, n + rows)
    bias = torch.randn(n) if rows % 2 else None
    packed = pack_q4_weight(q, scale, minimum, bias)
    x = torch.randn(rows, k) * torch.linspace(0.1, 8, k)
    x[0, 0] = 50.0  # an outlier: its block's other values quantize coarsely
    x[-1, :32] = 0.0  # an all-zero block: scale 0, nothing added

    got, qx, x_scales, x_sums = q4_linear(x, packed, keep_quantized=True)
    want_qx, want_scales, want_sums = quantize_blocks(x)
    assert torch.equal(qx, want_qx) and torch.equal(x_scales, want_scales)
    assert torch.equal(x_sums, want_sums)
    want = reference(qx, x_scales, x_sums, q, scale, minimum, bias)
    # Exact integer sums; per block one conversion, a multiply and one or two fused
    # multiply-adds, then the bias: a few fp32 roundings per block.
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * float(want.abs().max()))

    x16 = x.bfloat16()
    got16, qx16, scales16, sums16 = q4_linear(x16, packed, keep_quantized=True)
    # bf16 output: the fp32 result rounded once (to nearest even).
    assert torch.equal(got16, q4_linear(x16.float(), packed).bfloat16())


@pytest.mark.parametrize("threads", [1, 2])
# 1,040 x 288 is past the kernel's threshold for threads: 65 panels, 32 and 33 a thread.
@pytest.mark.parametrize("n,k", [(48, 96), (80, 160), (1040, 288)])
def test_decode_rows_on_odd_panels_and_blocks_equal_the_block_product(n, k, threads, needs_native):
    """Every decode row count 1..17 on a thread's odd run of panels (a two-panel tile then a
    one-panel tail, whose tiles fetch the next panels ahead while they compute) and odd
    block counts (3, 5, 9): the exact block product, and the same bits on 1 and 2 threads."""
    if needs_native is None:
        return
    q, scale, _ = random_blocks(n, k, False, n + k)
    packed = pack_q4_weight(q, scale, None, torch.randn(n))
    x_all = torch.randn(17, k, generator=torch.Generator().manual_seed(k)) * 4
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for rows in range(1, 18):
            got, qx, x_scales, x_sums = q4_linear(x_all[:rows], packed, keep_quantized=True)
            want = reference(qx, x_scales, x_sums, q, scale, None, packed.bias)
            torch.testing.assert_close(
                got.double(), want, rtol=0, atol=1e-6 * float(want.abs().max())
            )
            torch.set_num_threads(1)
            assert torch.equal(q4_linear(x_all[:rows], packed), got)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,k,rows", [(960, 576, 300), (80, 96, 45), (3072, 576, 64)])
def test_rows_and_threads_do_not_change_the_bits(n, k, rows, needs_native):
    """Rows are independent and each is computed in one fixed order: a call of many rows
    equals calls of 3 rows each, on one thread or on several."""
    if needs_native is None:
        return
    packed = pack_q4_weight(*random_blocks(n, k, True, rows), torch.randn(n))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, k) * 3).to(dtype)
        whole = q4_linear(x, packed)
        pieces = torch.cat([q4_linear(x[i : i + 3], packed) for i in range(0, rows, 3)])
        assert torch.equal(whole, pieces)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(q4_linear(x, packed), whole)
        finally:
            torch.set_num_threads(threads)


def test_a_block_with_a_nan_or_infinity_makes_its_row_nan(needs_native):
    if needs_native is None:
        return
    packed = pack_q4_weight(*random_blocks(32, 96, False, 1))
    x = torch.randn(3, 96)
    x[0, 40] = float("nan")
    x[1, 70] = float("inf")
    out = q4_linear(x, packed)
    assert out[0].isnan().all() and out[1].isnan().all()
    assert out[2].isfinite().all()


@pytest.mark.parametrize("affine", [False, True])
def test_the_bf16_expansion_is_exact(affine, needs_native):
    """d * q is exact in fp32: a symmetric weight is the dequantized value rounded once
    to bf16; an affine one d * q + min in fp32, then bf16."""
    n, k = 96, 160
    q, scale, minimum = random_blocks(n, k, affine, 5)
    got = unpack_q4_bf16(pack_q4_weight(q, scale, minimum))
    per = q.float().reshape(n, k // 32, 32)
    if affine:
        want = per * scale[..., None] + minimum[..., None]
    else:
        want = (per - 8) * scale[..., None]
    assert torch.equal(got, want.reshape(n, k).bfloat16())


def test_packing_refuses_what_the_kernel_cannot_hold():
    q, scale, minimum = random_blocks(32, 64, True, 2)
    with pytest.raises(ValueError, match="n % 16"):
        pack_q4_weight(q[:24], scale[:24], minimum[:24])
    with pytest.raises(ValueError, match="0..15"):
        pack_q4_weight(q + 1, scale, minimum)
    with pytest.raises(ValueError, match="scales in fp16"):
        pack_q4_weight(q, scale + 1e-6, minimum)
    with pytest.raises(ValueError, match="minimums in fp16"):
        pack_q4_weight(q, scale, minimum + 1e-6)


def test_bad_arguments_are_refused_before_the_kernel_runs(needs_native):
    if needs_native is None:
        return
    packed = pack_q4_weight(*random_blocks(32, 64, False, 3))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q4_linear(torch.randn(3, 64).half(), packed)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        q4_linear(torch.randn(3, 32), packed)


_CHILD = """
import hashlib, json, torch
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.q4_linear import native_q4_isa, pack_q4_weight, q4_linear
from tokenmill.engine.loader.gguf_blocks import DecodedWeight
from tokenmill.engine.quant.gguf_linear import gguf_module
isa = native_q4_isa()
torch.manual_seed(0)
q = torch.randint(0, 16, (48, 64))
scale = (torch.rand(48, 2) * 0.02 + 1e-4).half().float()
weight = DecodedWeight((q - 8).to(torch.int8), scale, None, 32)
result = {"built": native_library() is not None, "isa": isa,
          "module": type(gguf_module([weight], ["Q4_0"], None)).__name__}
if isa is not None:
    # The product at this build's tile edges, both block kinds and output types; a digest
    # of every output, to compare builds, and the worst error against the exact sums.
    digest, worst = hashlib.sha256(), 0.0
    for n, k, rows in [(16, 32, 1), (48, 64, 3), (80, 96, 5), (960, 576, 7), (576, 1536, 97)]:
        for affine in (False, True):
            gen = torch.Generator().manual_seed(n + rows)
            q = torch.randint(0, 16, (n, k), generator=gen)
            scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
            minimum = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float() if affine else None
            bias = torch.randn(n, generator=gen) if rows % 2 else None
            packed = pack_q4_weight(q, scale, minimum, bias)
            x = torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 8, k)
            for dtype in (torch.float32, torch.bfloat16):
                got, qx, xs, sums = q4_linear(x.to(dtype), packed, keep_quantized=True)
                digest.update(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes())
                digest.update(qx.numpy().tobytes())
                nb = k // 32
                isum = torch.einsum("rbj,nbj->rnb", qx.double().reshape(rows, nb, 32),
                                    q.double().reshape(n, nb, 32))
                mins = -8 * scale.double() if minimum is None else minimum.double()
                want = (xs.double()[:, None, :] * (scale.double()[None] * isum
                        + mins[None] * sums.double()[:, None, :])).sum(-1)
                want = want if bias is None else want + bias.double()
                if dtype == torch.float32:
                    worst = max(worst, float((got.double() - want).abs().max() / want.abs().max()))
    result.update(digest=digest.hexdigest(), worst=worst)
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def build_for(tmp_path_factory):
    """march -> what _CHILD reports on a library built for it (any x86-64 CPU with that
    march can run it), each built and run once for the module's tests."""
    results: dict[str, dict] = {}

    def run(march: str) -> dict:
        if march not in results:
            where = tmp_path_factory.mktemp(march)
            env = {
                **os.environ,
                "TOKENMILL_CACHE_DIR": str(where),
                "TOKENMILL_KERNEL_MARCH": march,
                "TOKENMILL_NATIVE_KERNELS": "1",
            }
            done = subprocess.run(
                [sys.executable, "-c", _CHILD],
                env=env,
                capture_output=True,
                text=True,
                cwd=where,
                check=True,
            )
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            results[march] = json.loads(line.removeprefix("RESULT "))
        return dict(results[march])

    return run


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="needs a CPU with AVX2 to run the build")
def test_an_avx2_build_gives_the_native_builds_bits(build_for):
    """A library built for an AVX2-only CPU (x86-64-v3) has the 4-bit product (int16 pair
    sums that cannot saturate, widened to int32), the gguf layers take it, and where this
    CPU has AVX512-VNNI it gives that build's bits exactly: the same integer sums and the
    same float steps per channel."""
    avx2 = build_for("x86-64-v3")
    assert avx2["built"] and avx2["isa"] == "avx2" and avx2["module"] == "Q4Linear"
    assert avx2["worst"] < 1e-6
    native = build_for("native")
    if native["isa"] not in (None, "avx2"):
        assert native["digest"] == avx2["digest"]


@pytest.mark.skipif("avx_vnni" not in cpu_flags(), reason="needs a CPU with AVX-VNNI")
def test_an_avx_vnni_build_gives_the_avx2_builds_bits(build_for):
    vnni = build_for("alderlake")
    assert vnni["isa"] == "avx_vnni" and vnni["module"] == "Q4Linear"
    assert vnni["digest"] == build_for("x86-64-v3")["digest"]


def test_a_build_without_avx2_keeps_the_int4_layers(build_for):
    """Built for baseline x86-64 the library has no 4-bit product: Q4_0 layers stay on
    PyTorch's int4 kernel (Int4Linear)."""
    plain = build_for("x86-64")
    assert plain["built"] and plain["isa"] is None and plain["module"] == "Int4Linear"
