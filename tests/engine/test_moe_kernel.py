"""The grouped expert kernel (kernels/moe.c) against a float64 reference that loops over
every (token, expert) pair, on this CPU's path and on the builds for other CPUs."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import OTHER_CPUS, build_with

from tokenmill.engine.kernels import cpu_flags, native_library
from tokenmill.engine.kernels import moe as moe_kernel

# (experts, hidden, intermediate, rows, top_k): a decode step's few rows per expert; runs
# of 16 rows and more (AMX tiles: hidden and intermediate multiples of 32) with a tail;
# sizes no multiple of the 32-column tile; every expert chosen by every row; runs of 11
# rows, on AMX tiles that read past the last run into the slack rows.
SHAPES = [
    (8, 64, 96, 5, 2),
    (4, 128, 96, 70, 2),
    (6, 130, 70, 33, 3),
    (3, 32, 64, 9, 3),
    (2, 64, 64, 11, 2),
]


def problem(shape, dtype, seed=0):
    num_experts, hidden, inter, rows, top_k = shape
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    logits = torch.randn(rows, num_experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k)
    return x, weights, ids, gate_up, down


def reference(x, weights, ids, gate_up, down) -> torch.Tensor:
    """Each pair on its own, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (
                down[e].double() @ (torch.nn.functional.silu(gate) * up)
            )
    return out


def tolerance(dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_experts_match_float64(shape, dtype):
    x, weights, ids, gate_up, down = problem(shape, dtype)
    packed = moe_kernel.PackedExperts(gate_up, down, "silu")
    got = packed(x, ids, weights)
    tol = tolerance(dtype)
    torch.testing.assert_close(
        got.double(), reference(x, weights, ids, gate_up, down), atol=tol, rtol=tol
    )


def clamped_swiglu_reference(x, weights, ids, gate_up, down, gate_up_bias, down_bias, alpha, limit):
    """gpt-oss's experts pair by pair in float64: biases, and (clamp(up) + 1) * g *
    sigmoid(alpha * g) with g = min(gate, limit)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            products = gate_up[e].double() @ x[t].double() + gate_up_bias[e].double()
            gate, up = products.chunk(2)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, j].double() * (down[e].double() @ h + down_bias[e].double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_biases_and_clamped_swiglu_match_float64(shape, dtype):
    """gpt-oss's experts: a bias on each projection and the clamped SwiGLU, its limit low
    enough that gate and up are clamped."""
    x, weights, ids, gate_up, down = problem(shape, dtype, seed=2)
    num_experts, hidden, inter, _, _ = shape
    g = torch.Generator().manual_seed(3)
    gate_up_bias = torch.randn(num_experts, 2 * inter, generator=g) * 0.2
    down_bias = torch.randn(num_experts, hidden, generator=g) * 0.2
    packed = moe_kernel.PackedExperts(
        gate_up,
        down,
        "clamped_swiglu",
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        swiglu=(1.702, 0.5),
    )
    want = clamped_swiglu_reference(
        x, weights, ids, gate_up, down, gate_up_bias, down_bias, 1.702, 0.5
    )
    tol = tolerance(dtype)
    torch.testing.assert_close(packed(x, ids, weights).double(), want, atol=tol, rtol=tol)
    unclamped = clamped_swiglu_reference(
        x, weights, ids, gate_up, down, gate_up_bias, down_bias, 1.702, 1e9
    )
    assert (unclamped - want).abs().max() > 0.1  # the limit is reached


@pytest.mark.parametrize("weight_format", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_experts_match_float64_of_their_dequantized_weights(shape, dtype, weight_format):
    """int8 weights (a scale per output column) and int4 ones (a scale and a minimum per
    group of 32 inputs), activations in fp32 or bf16: the sums of the weights the kernel
    holds, as exact as the float paths."""
    x, weights, ids, gate_up, down = problem(shape, dtype, seed=6)
    _, hidden, inter, _, _ = shape
    if weight_format == "int4" and (hidden % 32 or inter % 32):
        with pytest.raises(ValueError, match="multiples of 32"):
            moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=weight_format)
        return
    packed = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=weight_format)
    gate_up_q, down_q = packed.dequantized()
    # Within half a step of each weight: int8's step is a column's largest magnitude /
    # 127; int4's a group's range / 15 (at most twice the largest magnitude), its scale
    # and minimum rounded to bf16 besides.
    for original, held in ((gate_up, gate_up_q), (down, down_q)):
        amax = original.float().abs().amax()
        bound = amax / 254 * 1.01 if weight_format == "int8" else amax * (1 / 15 + 1 / 128)
        assert (held - original.float()).abs().max() <= bound
    got = packed(x, ids, weights)
    tol = tolerance(dtype)
    want = reference(x, weights, ids, gate_up_q, down_q)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def uneven_problem(dtype, seed=7):
    """Seven experts of 256 hidden (four down panels) and 64 intermediate, 40 tokens of
    three each, loaded unevenly: expert 0 chosen by no token, expert 1 by one (token 7),
    expert 2 by 33 (two 16-row AMX tiles and a row), experts 3-5 by the rest, expert 6 by
    every token (three terms a token: their order shows in the sum's bits)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(7, 128, 256, generator=g) * 0.1).to(dtype)
    down = (torch.randn(7, 256, 64, generator=g) * 0.1).to(dtype)
    x = torch.randn(40, 256, generator=g).to(dtype)
    tokens = torch.arange(40)
    first = torch.where(tokens < 33, 2, 4)
    second = torch.where(tokens == 7, 1, torch.where(tokens % 2 == 1, 3, 5))
    ids = torch.stack((first, second, torch.full_like(first, 6)), dim=1)
    weights = torch.rand(40, 3, generator=g) + 0.1
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("weight_format", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_and_weighted_sum_in_one_phase_give_the_same_bits(dtype, weight_format):
    """One thread runs down and the weighted sum as one phase, a panel of down columns
    over every expert (four panels, fuse_down); three threads cannot share four panels
    evenly and go through y per expert and panel. Each token's terms are added in the same
    order either way: the same bits, and both match float64, on uneven loads (experts with
    0, 1 and 33 tokens)."""
    x, weights, ids, gate_up, down = uneven_problem(dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=7).tolist()
    assert counts[:3] == [0, 1, 33] and counts[6] == 40
    packed = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=weight_format)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused = packed(x, ids, weights)
        torch.set_num_threads(3)
        apart = packed(x, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fused, apart)
    held = (gate_up, down) if weight_format == "float" else packed.dequantized()
    tol = tolerance(dtype)
    want = reference(x, weights, ids, *held)
    torch.testing.assert_close(fused.double(), want, atol=tol, rtol=tol)


def packed_as(weight_format, gate_up, down, dtype):
    """The experts in `weight_format`: "float", "int8", "int4", or "mxfp4" as stored
    (quant/mxfp4.py's blocks and scales, repacked)."""
    if weight_format != "mxfp4":
        return moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=weight_format)
    from tokenmill.engine.quant import mxfp4

    return moe_kernel.PackedExperts.from_mxfp4(
        mxfp4.quantize(gate_up), mxfp4.quantize(down), dtype, "silu"
    )


def decode_runs_problem(dtype, hidden, seed=8):
    """Six experts loaded as a decode step's runs come: 0, 1, 7, 15, 16 and 17 rows (the
    vector tiles; one AMX tile's pass, streamed over a quantized panel; one past it, over
    the widened panel), 28 tokens of two experts each."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(6, 128, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(6, hidden, 64, generator=g) * 0.1).to(dtype)
    x = torch.randn(28, hidden, generator=g).to(dtype)
    slots = torch.tensor([1] * 1 + [2] * 7 + [3] * 15 + [4] * 16 + [5] * 17)
    ids = torch.stack((slots[:28], slots[28:]), dim=1)
    weights = torch.rand(28, 2, generator=g) + 0.1
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("weight_format", ["float", "int8", "int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [256, 160])
def test_decode_runs_match_float64_in_every_weight_format(hidden, dtype, weight_format):
    """Runs of 0, 1, 7, 15, 16 and 17 rows, fp32 and bf16 activations, every weight
    format: the sums of the weights the kernel holds, within the float paths' tolerance.
    hidden 256 gives whole down panels (one pass over each), 160 a half panel last."""
    x, weights, ids, gate_up, down = decode_runs_problem(dtype, hidden)
    assert torch.bincount(ids.reshape(-1), minlength=6).tolist() == [0, 1, 7, 15, 16, 17]
    assert (ids[:, 0] != ids[:, 1]).all()
    packed = packed_as(weight_format, gate_up, down, dtype)
    held = (gate_up, down) if weight_format == "float" else packed.dequantized()
    tol = tolerance(dtype)
    want = reference(x, weights, ids, *held)
    torch.testing.assert_close(packed(x, ids, weights).double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("weight_format", ["int8", "int4", "mxfp4"])
def test_a_streamed_quantized_run_gives_the_widened_panels_bits(weight_format):
    """16 tokens on experts 0 and 1: each expert's run is one 16-row pass, whose quantized
    panels are widened 32 k-rows at a time as the tiles take them. A 17th token on experts
    0 and 2 makes expert 0's run two passes, over its panels widened whole first. Each
    row's sums are the same operations on the same bf16 weights either way: the first 16
    tokens' outputs are the same bits."""
    g = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    gate_up = (torch.randn(3, 128, 256, generator=g) * 0.1).to(dtype)
    down = (torch.randn(3, 256, 64, generator=g) * 0.1).to(dtype)
    x = torch.randn(17, 256, generator=g).to(dtype)
    ids = torch.tensor([[0, 1]] * 16 + [[0, 2]])
    weights = torch.rand(17, 2, generator=g) + 0.1
    packed = packed_as(weight_format, gate_up, down, dtype)
    streamed = packed(x[:16], ids[:16], weights[:16])
    widened = packed(x, ids, weights)
    assert torch.equal(streamed, widened[:16])
    tol = tolerance(dtype)
    want = reference(x, weights, ids, *packed.dequantized())
    torch.testing.assert_close(widened.double(), want, atol=tol, rtol=tol)


def test_int8_experts_take_a_quarter_of_fp32_bytes():
    x, weights, ids, gate_up, down = problem(SHAPES[1], torch.float32)
    full = moe_kernel.PackedExperts(gate_up, down, "silu")
    int8 = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format="int8")
    num_experts, two_inter, hidden = gate_up.shape
    scales = 4 * num_experts * (two_inter + hidden)
    assert int8.weight_bytes == full.weight_bytes // 4 + scales


def test_one_native_call_per_layer(monkeypatch):
    """However many experts the rows choose, the layer makes one call."""
    x, weights, ids, gate_up, down = problem(SHAPES[1], torch.float32)
    packed = moe_kernel.PackedExperts(gate_up, down, "silu")
    calls = []
    library = moe_kernel._library()
    monkeypatch.setattr(moe_kernel, "_library", lambda: CountingLibrary(library, calls))
    packed(x, ids, weights)
    assert calls == ["tm_moe"]


class CountingLibrary:
    def __init__(self, lib, calls):
        self.lib, self.calls = lib, calls

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.lib, name)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The kernels built with extra flags, each set compiled once for this module."""
    made = {}

    def build(flags):
        if flags not in made:
            made[flags] = build_with(flags, tmp_path_factory.mktemp("kernels"))
        return made[flags]

    return build


AVX512 = {"avx512f", "avx512bw", "avx512vl"}


@OTHER_CPUS
def test_kernel_built_for_other_cpus_matches_float64(flags, builds, monkeypatch):
    variant = builds(flags)
    avx512 = cpu_flags() >= AVX512 and flags == ("-mno-avx512bf16",)
    assert variant.limits.moe_isa == ("avx512" if avx512 else "avx2")
    monkeypatch.setattr(moe_kernel, "_library", lambda: variant.lib)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES[:3:2]:
            x, weights, ids, gate_up, down = problem(shape, dtype, seed=4)
            got = moe_kernel.PackedExperts(gate_up, down, "silu")(x, ids, weights)
            tol = tolerance(dtype)
            torch.testing.assert_close(
                got.double(), reference(x, weights, ids, gate_up, down), atol=tol, rtol=tol
            )
            int4_sizes = shape[1] % 32 == 0 and shape[2] % 32 == 0
            for weight_format in ("int8", "int4") if int4_sizes else ("int8",):
                held = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=weight_format)
                want = reference(x, weights, ids, *held.dequantized())
                got = held(x, ids, weights).double()
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            if int4_sizes:  # MXFP4 as stored, with gpt-oss's biases and activation
                from tokenmill.engine.quant import mxfp4

                biases = torch.randn(shape[0], 2 * shape[2]) * 0.2, torch.randn(shape[:2]) * 0.2
                held = moe_kernel.PackedExperts.from_mxfp4(
                    mxfp4.quantize(gate_up),
                    mxfp4.quantize(down),
                    dtype,
                    "clamped_swiglu",
                    gate_up_bias=biases[0],
                    down_bias=biases[1],
                    swiglu=(1.702, 0.5),
                )
                want = clamped_swiglu_reference(
                    x, weights, ids, *held.dequantized(), *biases, 1.702, 0.5
                )
                got = held(x, ids, weights).double()
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(
    not AVX512.issubset(cpu_flags()), reason="the AVX-512 build needs an AVX-512 CPU"
)
def test_avx2_build_gives_the_avx512_builds_bits(builds, monkeypatch):
    """The AVX2 tiles add the same products in the same order as the AVX-512 ones (bf16:
    each pair's odd k, then its even k, as vdpbf16ps), chunk after chunk of k: in every
    weight format, at runs of 1 to 6 rows and more, the same outputs to the bit."""
    from tokenmill.engine.quant import mxfp4

    avx2, avx512 = builds(("-march=x86-64-v3",)), builds(("-mno-avx512bf16",))
    assert (avx2.limits.moe_isa, avx512.limits.moe_isa) == ("avx2", "avx512")
    g = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, top_k = 6, 192, 160, 3  # k past one 64-row chunk, a tail
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
        down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(dtype)
        formats = {
            name: moe_kernel.PackedExperts(gate_up, down, "silu", weight_format=name)
            for name in ("float", "int8", "int4")
        }
        formats["mxfp4"] = moe_kernel.PackedExperts.from_mxfp4(
            mxfp4.quantize(gate_up), mxfp4.quantize(down), dtype, "silu"
        )
        for rows in (1, 2, 3, 5, 41):
            x = torch.randn(rows, hidden, generator=g).to(dtype)
            weights, ids = torch.softmax(torch.randn(rows, num_experts, generator=g), -1).topk(
                top_k
            )
            for name, packed in formats.items():
                outs = []
                for variant in (avx2, avx512):
                    monkeypatch.setattr(moe_kernel, "_library", lambda lib=variant.lib: lib)
                    outs.append(packed(x, ids, weights))
                assert torch.equal(*outs), (dtype, rows, name)


def test_this_cpu_gets_its_fastest_path(cpu_path):
    """Where the CPU has AVX512-BF16 (and AMX) the build uses it (Linux may withhold AMX's
    tile state; then the vector path is the right one); AVX-512 without it, and AVX2 with
    FMA, take their own vector tiles."""
    flags = cpu_flags()
    isa = native_library().limits.moe_isa
    cpu_path("MoE experts, native call", isa)
    if {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        assert isa in ("amx_bf16+avx512_bf16", "avx512_bf16")
    elif {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        assert isa == "avx512_bf16"
    elif flags >= AVX512:
        assert isa == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert isa == "avx2"
    else:
        assert isa == "generic"


def test_each_panel_is_one_block_of_its_columns():
    """Expert e's panel j is one contiguous block of k-rows: gate columns 32j.. then the same
    up columns (gate_up), or hidden columns 64j.. (down), zeros past the last column - what
    each work item of the kernel streams."""
    _, _, _, gate_up, down = problem(SHAPES[2], torch.float32)  # 70 intermediate, 130 hidden
    packed = moe_kernel.PackedExperts(gate_up, down, "silu", weight_format="int8")
    gate_up_q, _ = moe_kernel.quantize_int8(gate_up)
    down_q, _ = moe_kernel.quantize_int8(down)
    assert tuple(packed.gate_up.shape) == (6, 3, 130, 64)  # ceil(70 / 32) panels
    assert tuple(packed.down.shape) == (6, 3, 70, 64)  # ceil(130 / 64) panels
    assert packed.gate_up[4, 1].is_contiguous()
    torch.testing.assert_close(packed.gate_up[4, 1, :, :32], gate_up_q[4, 32:64].T)
    torch.testing.assert_close(packed.gate_up[4, 1, :, 32:], gate_up_q[4, 70 + 32 : 70 + 64].T)
    torch.testing.assert_close(
        packed.gate_up[4, 2, :, 6:32], torch.zeros(130, 26, dtype=torch.int8)
    )
    torch.testing.assert_close(packed.gate_up[4, 2, :, 32:38], gate_up_q[4, 134:140].T)
    torch.testing.assert_close(packed.down[4, 2, :, :2], down_q[4, 128:130].T)
    assert not packed.down[4, 2, :, 2:].any()


@pytest.mark.parametrize("change", ["expert out of range", "top_k too large", "panel width"])
def test_bad_choices_are_refused(change, monkeypatch):
    x, weights, ids, gate_up, down = problem(SHAPES[0], torch.float32)
    packed = moe_kernel.PackedExperts(gate_up, down, "silu")
    if change == "panel width":  # weights packed in another layout than the kernel reads
        monkeypatch.setattr(moe_kernel, "PANEL_COLS", 32)
    elif change == "expert out of range":
        ids = ids.clone()
        ids[3, 1] = 8
    else:
        ids = torch.arange(9).repeat(5, 1) % 8
        weights = torch.ones(5, 9)
    with pytest.raises(ValueError, match="do not take this shape"):
        packed(x, ids, weights)
