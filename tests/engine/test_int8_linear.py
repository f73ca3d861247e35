"""The native int8 linear (kernels/int8_linear.c): it quantizes rows as the quantizer
does, its product equals the integer product it stands for at every tile edge, on each
instruction set it is built for (AMX, AVX512-VNNI, AVX2), and it is chosen only where the
library has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.kernels import cpu_flags, elementwise
from tokenmill.engine.kernels.int8_linear import (
    int8_linear,
    native_int8_isa,
    pack_int8_weight,
    takes_gated,
)
from tokenmill.engine.kernels.quantize import FULL_RANGE, quantize_rows_u8
from tokenmill.engine.quant.int8 import Int8Linear, choose_kernel, quantize_weight


def reference(qx, x_scales, qweight, w_scales, bias) -> torch.Tensor:
    """The product in float64 from the exact integer sums."""
    acc = (qx.long() - FULL_RANGE[1]) @ qweight.long().t()
    out = acc.double() * x_scales.double()[:, None] * w_scales.double()[None, :]
    return out if bias is None else out + bias.double()


@pytest.fixture
def needs_native(cpu_path):
    isa = native_int8_isa()
    cpu_path("int8 linear, native kernel", isa or "not built for this CPU (oneDNN instead)")
    if isa is None:
        # Where it is not built the layers must not choose it; that is what this CPU
        # can check (test_the_kernel_is_left_out_where_the_cpu_lacks_vnni builds one).
        assert choose_kernel(960, 576) == "onednn"
    return isa


# Shapes cover every register tile edge: VNNI's 1-6 rows of a tile, one to four 16-channel
# panels, row blocks of 120; where the CPU has AMX (k % 64 == 0, from 8 rows), one or two
# 16-row tiles and a zero-padded last one (or only one, at 8-15 rows), one or two panels a
# block, k of one tile step; the model's own layers.
@pytest.mark.parametrize(
    "n,k", [(16, 4), (48, 8), (112, 36), (48, 64), (80, 128), (960, 576), (576, 1536)]
)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 12, 31, 32, 33, 64, 121, 250, 300])
def test_native_linear_equals_the_integer_product(n, k, rows, needs_native):
    if needs_native is None:
        return
    torch.manual_seed(n * 1000 + rows)
    qweight, w_scales = quantize_weight(torch.randn(n, k))
    qweight[0] = 127  # extreme values: the zero-point correction and sums at their widest
    qweight[-1] = -127
    bias = torch.randn(n) if rows % 2 else None
    x = torch.randn(rows, k) * torch.linspace(0.1, 8, k)
    x[0, 0] = 50.0  # one outlier: that row's values sit at the ends of the range
    smooth = (torch.rand(k) + 0.5) if rows % 3 else None
    packed = pack_int8_weight(qweight, w_scales, bias)

    got, qx, x_scales = int8_linear(x, packed, smooth, keep_quantized=True)
    # The rows are quantized exactly as the stand-alone quantizer does (shared code).
    want_qx, want_scales = quantize_rows_u8(x, smooth)
    assert torch.equal(qx, want_qx) and torch.equal(x_scales, want_scales)
    want = reference(qx, x_scales, qweight, w_scales, bias)
    # Integer sums are exact; one fp32 conversion and a fused multiply-add round after.
    torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=1e-6 * float(want.abs().max()))

    got_bf16, qx_bf16, scales_bf16 = int8_linear(x.bfloat16(), packed, smooth, keep_quantized=True)
    want = reference(qx_bf16, scales_bf16, qweight, w_scales, bias)
    # bf16 output: the fp32 value rounded once (to nearest even) - the reference rounded
    # the same way, except where the fp32 values themselves differ in the last bit.
    rounded = want.float().bfloat16()
    assert float((got_bf16 != rounded).float().mean()) < 2e-3
    torch.testing.assert_close(got_bf16.float(), rounded.float(), rtol=2**-7, atol=1e-30)


def test_the_layers_take_the_native_kernel_where_it_fits(needs_native):
    if needs_native is None:
        return
    assert choose_kernel(960, 576) == "native"
    assert choose_kernel(40, 576) == "onednn"  # not a whole number of 16-channel panels
    assert choose_kernel(960, 30) == "onednn"  # k not a whole number of 4-byte steps
    with pytest.raises(ValueError, match="does not take"):
        Int8Linear.from_float(torch.randn(40, 64), kernel="native")
    layer = Int8Linear.from_float(torch.randn(96, 64))
    assert layer.kernel == "native" and not hasattr(layer, "packed_weight")
    # Its activations use all 8 bits on every instruction set (AVX2 included: its int16
    # step would saturate on u8 x s8 pairs at full range, so it multiplies s8 x s8).
    assert layer.value_range == FULL_RANGE


def test_a_cpu_with_amx_takes_the_native_kernel(monkeypatch, needs_native):
    """Measured on an AMX CPU, the native kernel (tiles from 8 rows, VNNI below) beat the
    layers on oneDNN's AMX kernels: oneDNN reporting AMX no longer keeps them."""
    if needs_native is None:
        return
    import tokenmill.engine.quant.int8 as int8

    monkeypatch.setattr(int8, "kernel_name", lambda: "avx512_core_amx")
    assert int8.choose_kernel(960, 576) == "native"


# (1120, 4096): on AMX a thread's 35 panels take three L2-sized blocks (16, 16 and an odd 3).
@pytest.mark.parametrize(
    "n,k,rows",
    [(960, 576, 300), (80, 128, 45), (576, 1536, 64), (960, 576, 12), (1120, 4096, 45)],
)
def test_every_row_count_gives_the_same_bits(n, k, rows, needs_native):
    """Rows are independent: a call of many rows (AMX tiles where the CPU has them) equals,
    bit for bit, calls of 7 rows each (VNNI: tiles take 8 or more) - both paths sum the same
    integers exactly and share one epilogue's arithmetic."""
    if needs_native is None:
        return
    torch.manual_seed(rows)
    packed = pack_int8_weight(*quantize_weight(torch.randn(n, k)), torch.randn(n))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, k) * 3).to(dtype)
        whole = int8_linear(x, packed)
        pieces = torch.cat([int8_linear(x[i : i + 7], packed) for i in range(0, rows, 7)])
        assert torch.equal(whole, pieces)


def test_reused_scratch_gives_each_call_and_thread_its_own_result(needs_native):
    """The quantized activations go to per-thread buffers kept across calls: calls that
    grow them, shrink back, and run in two threads at once give what fresh buffers
    (keep_quantized) give."""
    if needs_native is None:
        return
    import threading

    torch.manual_seed(7)
    packed = pack_int8_weight(*quantize_weight(torch.randn(576, 1536)))
    inputs = [torch.randn(rows, 1536).bfloat16() for rows in (3, 700, 1, 2048, 64)]
    wants = [int8_linear(x, packed, keep_quantized=True)[0] for x in inputs]
    for x, want in zip(inputs, wants):
        assert torch.equal(int8_linear(x, packed), want)

    mismatches = []

    def run(order):
        for _ in range(5):
            for i in order:
                if not torch.equal(int8_linear(inputs[i], packed), wants[i]):
                    mismatches.append(i)

    threads = [threading.Thread(target=run, args=(o,)) for o in ([0, 1, 2, 3, 4], [3, 4, 1, 0, 2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == []


def test_bad_arguments_are_refused_before_the_kernel_runs(needs_native):
    if needs_native is None:
        return
    packed = pack_int8_weight(*quantize_weight(torch.randn(32, 16)))
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        int8_linear(x.half(), packed)
    with pytest.raises(ValueError, match=r"\[rows, 16\]"):
        int8_linear(x[:, :12], packed)
    with pytest.raises(ValueError, match="smoothing"):
        int8_linear(x, packed, torch.ones(12))


@pytest.fixture
def needs_gated(needs_native):
    """Whether this build applies a gated MLP's activation in the product's epilogue
    (every build with a native product; the AVX2 builds' in a subprocess:
    test_an_avx2_build_runs_the_avx2_kernel)."""
    return needs_native is not None and takes_gated(64, 64)


_GATED = {"silu": elementwise.silu_and_mul, "gelu_pytorch_tanh": elementwise.gelu_tanh_and_mul}


def _gated_reference(y: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up in float64 from a [rows, 2 * I] product's two halves."""
    gate, up = y.double().chunk(2, dim=1)
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# One gate/up pair of panels and several; k of one AMX step and the model's; rows on VNNI
# (1-7), on AMX tiles (8 on, with a zero-padded tail) and past one 32-row strip.
@pytest.mark.parametrize("half,k", [(16, 64), (48, 576), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
@pytest.mark.parametrize("activation", sorted(_GATED))
def test_the_gated_epilogue_gives_the_activation_of_the_product(
    half, k, rows, activation, needs_gated
):
    """A [gate; up] weight packed a panel of each in turn: the kernel's act(gate) * up
    equals the fused elementwise op on the plain product, bit for bit in fp32 (the same
    exp, the same formula, the same fp32 gate and up), and in bf16 that value rounded
    once."""
    if not needs_gated:
        return
    torch.manual_seed(half + rows)
    qweight, w_scales = quantize_weight(torch.randn(2 * half, k))
    bias = torch.randn(2 * half) if rows % 2 else None
    plain = pack_int8_weight(qweight, w_scales, bias)
    gated = pack_int8_weight(qweight, w_scales, bias, gated=True)
    x = torch.randn(rows, k) * 2
    product = int8_linear(x, plain)
    got = int8_linear(x, gated, activation=activation)
    assert got.shape == (rows, half)
    assert torch.equal(got, _GATED[activation](product))
    # bf16 activations: the product of the same (bf16-valued) rows, in fp32, then rounded
    # once - where the unfused path rounds gate_up, then act(gate), then the product.
    x16 = x.bfloat16()
    want = _gated_reference(int8_linear(x16.float(), plain), activation)
    got16 = int8_linear(x16, gated, activation=activation)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), want, rtol=2**-8, atol=1e-6)


def test_a_gated_layer_computes_what_a_plain_one_does(needs_gated):
    """An Int8Linear built as a gated MLP's gate_up fuses the activation where the kernel
    can; its plain forward still gives [gate, up] in their order (2-D and 3-D inputs),
    the same bits as a plain layer, and it refuses another activation."""
    torch.manual_seed(3)
    weight, smooth = torch.randn(96, 64), torch.rand(64) + 0.5
    plain = Int8Linear.from_float(weight, smooth=smooth)
    gated = Int8Linear.from_float(weight, smooth=smooth, gated_activation="silu")
    assert plain.fused_activation is None
    if not needs_gated:
        assert gated.fused_activation is None
        with pytest.raises(ValueError, match="fuses None"):
            gated(torch.randn(3, 64), activation="silu")
        return
    assert gated.fused_activation == "silu" and gated.packed.gated
    for x in (torch.randn(9, 64), torch.randn(2, 5, 64), torch.randn(9, 64).bfloat16()):
        assert torch.equal(gated(x), plain(x))
    x = torch.randn(12, 64)
    assert torch.equal(gated(x, activation="silu"), elementwise.silu_and_mul(plain(x)))
    assert gated(torch.randn(2, 5, 64), activation="silu").shape == (2, 5, 48)
    with pytest.raises(ValueError, match="not 'gelu_pytorch_tanh'"):
        gated(x, activation="gelu_pytorch_tanh")


def test_a_gated_call_needs_a_gated_weight(needs_gated):
    if not needs_gated:
        return
    qweight, w_scales = quantize_weight(torch.randn(64, 32))
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="needs a gated weight"):
        int8_linear(x, pack_int8_weight(qweight, w_scales), activation="silu")
    with pytest.raises(ValueError, match="needs a gated weight"):
        int8_linear(x, pack_int8_weight(qweight, w_scales, gated=True), activation="relu")
    with pytest.raises(ValueError, match="multiple of 32 rows"):
        pack_int8_weight(*quantize_weight(torch.randn(48, 32)), gated=True)


_CHILD = """
import hashlib, json, torch
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.int8_linear import (
    int8_linear, native_int8_isa, pack_int8_weight, takes_gated)
from tokenmill.engine.kernels.quantize import FULL_RANGE, quantize_rows_u8
from tokenmill.engine.quant.int8 import Int8Linear, choose_kernel, quantize_weight
isa = native_int8_isa()
layer = Int8Linear.from_float(torch.randn(96, 64))
result = {"built": native_library() is not None, "isa": isa, "choice": choose_kernel(96, 64),
          "layer": layer.kernel, "rows": layer(torch.randn(5, 64)).shape[0],
          "takes_gated": takes_gated(96, 64)}
if isa is not None:
    # Asked anyway, the kernel itself refuses the gated epilogue where it lacks it.
    try:
        int8_linear(torch.randn(3, 64), pack_int8_weight(*quantize_weight(torch.randn(96, 64)),
                    gated=True), activation="silu")
        result["gated_call"] = "ran"
    except RuntimeError as error:
        result["gated_call"] = "refused" if "built without" in str(error) else str(error)
    # The gated epilogue (act(gate) * up of each gate/up pair of panels) against this
    # build's fused elementwise op on the plain product: the same bits in fp32 (the same
    # vector exp, the same formula); in bf16, that fp32 value rounded once. Shapes at the
    # AVX2 tile's row edges (1-4), past a 120-row block, and one pair to 96 pairs.
    from tokenmill.engine.kernels import elementwise
    fused = {"silu": elementwise.silu_and_mul, "gelu_pytorch_tanh": elementwise.gelu_tanh_and_mul}
    gated_equal = []
    for half, k, rows in [(16, 64, 1), (48, 576, 3), (48, 576, 4), (1536, 576, 9), (32, 128, 121)]:
        torch.manual_seed(half + rows)
        qweight, w_scales = quantize_weight(torch.randn(2 * half, k))
        bias = torch.randn(2 * half) if rows % 2 else None
        x = torch.randn(rows, k) * 2
        product = int8_linear(x, pack_int8_weight(qweight, w_scales, bias))
        gated = pack_int8_weight(qweight, w_scales, bias, gated=True)
        x16 = x.bfloat16()
        for name, op in fused.items():
            got = int8_linear(x, gated, activation=name)
            got16 = int8_linear(x16, gated, activation=name)
            once = int8_linear(x16.float(), gated, activation=name).bfloat16()
            gated_equal.append(torch.equal(got, op(product)) and torch.equal(got16, once))
    result["gated_equal"] = all(gated_equal)
    # compressed-tensors' rounding (codes down to -128): taken, or refused by the kernel.
    from tokenmill.engine.kernels.int8_linear import takes_full_rounding
    result["takes_full_rounding"] = takes_full_rounding()
    x = torch.randn(3, 64)
    x[:, 0] = -127.5  # each row's largest magnitude: scale 1, code -128
    try:
        _, qx, _ = int8_linear(x, pack_int8_weight(*quantize_weight(torch.randn(96, 64))),
                               keep_quantized=True, rounding="full")
        result["full_call"] = "ran" if torch.equal(qx, quantize_rows_u8(
            x, None, FULL_RANGE, "full")[0]) and int(qx.min()) == 0 else "differs"
    except ValueError as error:
        result["full_call"] = "refused" if "do not take" in str(error) else str(error)
    # The product against the exact integer sums at the tile edges (AVX2: 1-4 rows a
    # tile, 120-row blocks; VNNI 1-6 rows, AMX from 8), both output types; and a digest of
    # every output, to compare builds.
    worst, digest = {"fp32": 0.0, "bf16": 0.0}, hashlib.sha256()
    for n, k, rows in [(16, 4, 1), (48, 36, 3), (112, 64, 4), (32, 576, 5), (960, 576, 7),
                       (576, 1536, 121), (80, 128, 250)]:
        torch.manual_seed(rows)
        qweight, w_scales = quantize_weight(torch.randn(n, k))
        qweight[0], qweight[-1] = 127, -127
        bias = torch.randn(n) if rows % 2 else None
        x = torch.randn(rows, k) * torch.linspace(0.1, 8, k)
        x[0, 0] = 50.0
        packed = pack_int8_weight(qweight, w_scales, bias)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            got, qx, scales = int8_linear(x.to(dtype), packed, keep_quantized=True)
            want_qx, want_scales = quantize_rows_u8(x.to(dtype))
            assert torch.equal(qx, want_qx) and torch.equal(scales, want_scales)
            acc = (qx.long() - FULL_RANGE[1]) @ qweight.long().t()
            want = acc.double() * scales.double()[:, None] * w_scales.double()[None, :]
            want = want if bias is None else want + bias.double()
            err = float(((got.double() - want).abs() / (want.abs() + 1e-3)).max())
            worst[name] = max(worst[name], err)
            digest.update(got.view(torch.int16 if name == "bf16" else torch.int32).numpy().tobytes())
    result.update(worst=worst, digest=digest.hexdigest())
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def build_for(tmp_path_factory):
    """march -> what _CHILD reports on a library built for it (any x86-64 CPU with that
    march can run it). Each march is built and run once for the module's tests."""
    results: dict[str, dict] = {}

    def run(march: str) -> dict:
        if march not in results:
            where = tmp_path_factory.mktemp(march)
            env = {
                **os.environ,
                "TOKENMILL_CACHE_DIR": str(where),
                "TOKENMILL_KERNEL_MARCH": march,
                "TOKENMILL_NATIVE_KERNELS": "1",  # the suite may run with them off
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
def test_an_avx2_build_runs_the_avx2_kernel(build_for):
    """A library built for an AVX2-only CPU (x86-64-v3: no AVX-512, no VNNI; AMD Zen 1/2)
    has the AVX2 product: the layers choose it, it equals the integer product of 8-bit
    activations, rounded once, and where this CPU has VNNI or AMX it gives the native
    build's bits exactly (the same integer sums, the same epilogue). It applies a gated
    MLP's activation in its epilogue too (a gate panel's tile, then its up panel's): the
    fused elementwise op's bits in fp32, that value rounded once in bf16."""
    avx2 = build_for("x86-64-v3")
    worst, digest = avx2.pop("worst"), avx2.pop("digest")
    assert avx2 == {
        "built": True,
        "isa": "avx2",
        "choice": "native",
        "layer": "native",
        "rows": 5,
        "takes_gated": True,  # a gate panel's tile, then its up panel's
        "gated_call": "ran",
        "gated_equal": True,
        # -128 has no sign for vpsignb to flip: a W8A8 checkpoint there rounds as int8 does
        "takes_full_rounding": False,
        "full_call": "refused",
    }
    assert worst["fp32"] < 1e-5  # one fp32 conversion and a fused multiply-add
    assert worst["bf16"] < 2**-8  # and one rounding to bf16
    native = build_for("native")
    if native["isa"] not in (None, "avx2"):
        assert native["digest"] == digest


@pytest.mark.skipif("avx_vnni" not in cpu_flags(), reason="needs a CPU with AVX-VNNI")
def test_an_avx_vnni_build_gives_the_avx2_builds_bits(build_for):
    """A build for AVX2 with AVX-VNNI and no AVX-512 (alderlake: Intel's hybrid clients,
    Sierra Forest) sums u8 x s8 in int32 with 256-bit vpdpbusd, and takes the zero point
    off in its epilogue: the same bits as the AVX2 build's signed pairs."""
    vnni = build_for("alderlake")
    avx2 = build_for("x86-64-v3")
    assert vnni["isa"] == "avx_vnni" and vnni["layer"] == "native"
    assert vnni["takes_gated"] and vnni["gated_equal"]
    assert vnni["takes_full_rounding"] and vnni["full_call"] == "ran"
    assert vnni["worst"]["fp32"] < 1e-5 and vnni["worst"]["bf16"] < 2**-8
    assert vnni["digest"] == avx2["digest"]


def test_the_kernel_is_left_out_where_the_cpu_lacks_avx2(build_for):
    """A build for a CPU without AVX2 (x86-64-v2) has no native int8 product; it says so
    through tm_limits and the layers run oneDNN's."""
    result = build_for("x86-64-v2")
    assert result == {
        "built": True,
        "isa": None,
        "choice": "onednn",
        "layer": "onednn",
        "rows": 5,
        "takes_gated": False,
    }


def test_panels_moved_as_words_are_the_permuted_bytes():
    """pack_int8_weight's panels, moved as int32 words, are the int8 permute's bytes - for
    a weight of its own and a row slice starting off a word boundary (the fallback)."""
    from tokenmill.engine.kernels.int8_linear import K_STEP, PANEL, _panels

    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (97, 64), dtype=torch.int8, generator=gen)
    for weight in (q[:96], q.view(-1)[1 : 1 + 96 * 64].view(96, 64)):
        n, k = weight.shape
        want = weight.reshape(n // PANEL, PANEL, k // K_STEP, K_STEP).permute(0, 2, 1, 3)
        assert torch.equal(_panels(weight), want.contiguous())
