"""The native LoRA call (engine/kernels/lora.c) against float64: every run of rows' terms
in one call, on row and column tails, padded and zero ranks, rows no run covers; the
builds other CPUs get; the shapes it refuses; and the wrapper's native and matmul paths
on the same weights."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import OTHER_CPUS, build_with

from tokenmill.engine import kernels
from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.kernels import native_library
from tokenmill.engine.lora.layers import LoRALinear, LoRAStep, SlotWeights

# Output columns: no multiple of the 32-column tile. Input: 80 = 2.5 AMX k-steps (the
# shrink's 16-k tail), 72 none (the vector tiles for every row).
IN, OUT = 80, 100
# Per slot: rank columns and (col_lo, col_hi, out_lo, out_hi) blocks, as the runner
# prepares a fused layer's targets; slot 2 has no target in the layer.
SLOTS = [
    (12, ((0, 4, 0, 40), (4, 8, 40, 70), (8, 12, 70, 100))),
    (34, ((0, 34, 0, 100),)),
    (0, ()),
    (6, ((0, 2, 17, 18), (2, 6, 60, 99))),
]
# (slot, first row, end row): one row, tails of the 8-row tile, rows 30-32 and 60-62 in
# no run, the same slot twice.
RUNS = [(1, 0, 1), (0, 1, 13), (3, 13, 30), (2, 32, 40), (1, 40, 60), (0, 62, 80)]
ROWS = 80


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if native_library() is None:
        pytest.fail("the native kernel did not build; is a C compiler installed?")


def operands(dtype, seed=0, in_features=IN):
    """x, y, and each slot's A [in, rank] and B [rank, out] (zero outside its blocks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, in_features, generator=gen).to(dtype)
    y = torch.randn(ROWS, OUT, generator=gen).to(dtype)
    weights = []
    for rank, blocks in SLOTS:
        a = torch.randn(in_features, rank, generator=gen).to(dtype)
        b = torch.zeros(rank, OUT, dtype=dtype)
        for lo, hi, out_lo, out_hi in blocks:
            b[lo:hi, out_lo:out_hi] = torch.randn(hi - lo, out_hi - out_lo, generator=gen)
        weights.append((a, b, blocks))
    return x, y, weights


def reference(x, y, weights, runs):
    """y plus each run's term in float64; bf16 rounds x @ A to bf16 first, as documented."""
    want = y.double().clone()
    for slot, first, end in runs:
        a, b, _ = weights[slot]
        if a.shape[1] == 0:
            continue
        t = (x[first:end].double() @ a.double()).to(x.dtype).double()
        want[first:end] += t @ b.double()
    return want


def wrapper(dtype, weights, native=True) -> LoRALinear:
    layer = LoRALinear(torch.nn.Identity(), LoRAStep(), len(weights), native=native)
    for slot, (a, b, blocks) in enumerate(weights):
        layer.set_slot(slot, SlotWeights(a, b, blocks=blocks) if a.shape[1] else None)
    return layer


@pytest.mark.parametrize("in_features", [IN, 72])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_run_matches_float64(dtype, in_features):
    x, y, weights = operands(dtype, in_features=in_features)
    layer = wrapper(dtype, weights)
    assert layer.pairs == (dtype == torch.bfloat16)
    got = y.clone()
    lora_kernel.add_lora_terms(
        x, got, layer.a, layer.b, torch.tensor(RUNS), layer.slot_ranks,
        layer.slot_blocks, layer.slot_num_blocks,
    )  # fmt: skip
    want = reference(x, y, weights, RUNS)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # Rows no run covers, and a slot with no target in the layer, are left as they were.
    for untouched in (slice(30, 32), slice(32, 40), slice(60, 62)):
        assert torch.equal(got[untouched], y[untouched])
    assert (got[1:13] - y[1:13]).abs().max() > 1.0  # the terms are not small


class BaseOutput(torch.nn.Module):
    """A stand-in base layer whose output is a copy of y, for the terms to add to."""

    def __init__(self, y: torch.Tensor) -> None:
        super().__init__()
        self.y = y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.y.clone()


def check_bf16_rounding():
    """bf16 y + term rounds to nearest even, once: terms exact in fp32 put 1 + term on ties
    (to even: down, and up), past a tie, below one, and a NaN in x gives NaN terms - which
    a truncation, or a rounding add carried into an infinity, would miss."""
    out = 40  # a whole 32-column tile and a tail
    x = torch.zeros(2, 4)
    x[:, 0] = 1.0
    x[1, 1] = float("nan")
    a = torch.zeros(4, 2)
    a[0, 0] = 1.0  # t = x[:, 0] exactly (and NaN in row 1)
    b = torch.zeros(2, out)
    steps = torch.tensor([1.0, 3.0, 1.0 + 2**-4, 3.0 - 2**-4, -1.0, -3.0, 0.5, 5.0]) * 2**-8
    b[0] = steps.repeat(out // len(steps))
    x, a, b = x.bfloat16(), a.bfloat16(), b.bfloat16()
    y = torch.ones(2, out, dtype=torch.bfloat16)
    layer = wrapper(torch.bfloat16, [(a, b, ((0, 2, 0, out),))])
    got = y.clone()
    lora_kernel.add_lora_terms(
        x, got, layer.a, layer.b, torch.tensor([(0, 0, 2)]), layer.slot_ranks,
        layer.slot_blocks, layer.slot_num_blocks,
    )  # fmt: skip
    want = (y[0].float() + b[0].float()).bfloat16()  # PyTorch rounds to nearest even
    assert torch.equal(got[0], want)
    assert got[0].unique().numel() > 3  # the cases round to different values
    assert got[1].isnan().all()


def test_bf16_rounds_to_nearest_even():
    check_bf16_rounding()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_matmul_paths_agree(dtype):
    """The wrapper's native call and its per-run matmuls, on the same adapters."""
    x, y, weights = operands(dtype, seed=1)
    outputs = []
    for native in (True, False):
        layer = wrapper(dtype, weights, native=native)
        layer.base_layer = BaseOutput(y)
        step = layer.step
        step.runs = torch.tensor(RUNS, dtype=torch.int64)
        step.segments, step.is_active = list(RUNS), True
        outputs.append(layer(x))
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outputs[0], outputs[1], atol=tol, rtol=tol)


# The path each build takes: OTHER_CPUS', and baseline x86-64 (SSE2), the one build left
# on the plain loops.
OTHER_CPU_ISAS = {
    ("-mno-avx512bf16",): "avx512",
    ("-march=x86-64-v3",): "avx2",
    ("-march=x86-64",): "generic",
}


@OTHER_CPUS
def test_kernel_built_for_other_cpus_matches_float64(flags, tmp_path, monkeypatch):
    check_build(flags, tmp_path, monkeypatch)


def test_plain_loops_match_float64(tmp_path, monkeypatch):
    check_build(("-march=x86-64",), tmp_path, monkeypatch)


def check_build(flags, tmp_path, monkeypatch):
    """The kernels built with `flags` take their path and match float64 in fp32 and bf16."""
    variant = build_with(flags, tmp_path)
    assert variant.limits.lora_isa == OTHER_CPU_ISAS[flags]
    monkeypatch.setattr(lora_kernel, "_library", lambda: variant.lib)
    for dtype in (torch.float32, torch.bfloat16):
        x, y, weights = operands(dtype, seed=2)
        layer = wrapper(dtype, weights)
        got = y.clone()
        lora_kernel.add_lora_terms(
            x, got, layer.a, layer.b, torch.tensor(RUNS), layer.slot_ranks,
            layer.slot_blocks, layer.slot_num_blocks,
        )  # fmt: skip
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got.double(), reference(x, y, weights, RUNS), atol=tol, rtol=tol)
    check_bf16_rounding()


def test_this_cpu_gets_its_fastest_path(cpu_path):
    """Where the CPU has AVX512-BF16 (and AMX) the build uses it: no slow path by accident.
    (Linux may withhold AMX's tile state; then the vector path is the right one.)"""
    flags = kernels.cpu_flags()
    isa = native_library().limits.lora_isa
    cpu_path("LoRA terms, native call", isa)
    if {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        assert isa in ("amx_bf16+avx512_bf16", "avx512_bf16")
    elif {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        assert isa == "avx512_bf16"
    elif {"avx512f", "avx512bw"} <= flags:
        assert isa == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert isa == "avx2"
    else:
        assert isa == "generic"


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("a slot past the stacks", lambda runs, blocks: runs.__setitem__((0, 0), 9)),
        ("rows past x", lambda runs, blocks: runs.__setitem__((5, 2), ROWS + 1)),
        ("blocks writing the same columns", lambda runs, blocks: blocks.__setitem__((0, 1, 2), 30)),
        ("a block past the rank", lambda runs, blocks: blocks.__setitem__((0, 2, 1), 14)),
    ],
)
def test_bad_tables_are_refused(what, change):
    x, y, weights = operands(torch.float32)
    layer = wrapper(torch.float32, weights)
    runs, blocks = torch.tensor(RUNS), layer.slot_blocks.clone()
    change(runs, blocks)
    before = y.clone()
    with pytest.raises(ValueError, match="do not take this shape"):
        lora_kernel.add_lora_terms(
            x,
            y,
            layer.a,
            layer.b,
            runs,
            layer.slot_ranks,
            blocks,
            layer.slot_num_blocks,
        )
    assert torch.equal(y, before), what  # refused before writing anything
