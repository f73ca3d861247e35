"""int8 linear layers: the kernel computes the quantized product exactly, stays close to
the float product, and runs on the fast path where the CPU has it and on the fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.kernels.int8_linear import native_int8_isa
from tokenmill.engine.kernels.quantize import FULL_RANGE, quantize_rows_u8
from tokenmill.engine.quant import calibrate
from tokenmill.engine.quant.int8 import (
    Int8Linear,
    choose_kernel,
    kernel_name,
    padded_rows,
    quantize_weight,
)


def test_native_quantizer_matches_the_pytorch_ops(monkeypatch):
    x = torch.randn(37, 200) * torch.linspace(0.1, 30, 200)
    x[5] = 0  # an all-zero row gets scale 1
    inv_smooth = torch.rand(200) + 0.5
    for dtype in (torch.float32, torch.bfloat16):
        for smooth in (None, inv_smooth):
            native = quantize_rows_u8(x.to(dtype), smooth)
            import tokenmill.engine.kernels.quantize as module

            monkeypatch.setattr(module, "_library", lambda: None)
            reference = quantize_rows_u8(x.to(dtype), smooth)
            monkeypatch.undo()
            torch.testing.assert_close(native[1], reference[1], rtol=1e-6, atol=0)
            # The C build may form a scale or a product one ulp apart (-ffast-math), so a
            # value at a rounding tie may land on the other side; never further.
            difference = (native[0].int() - reference[0].int()).abs()
            assert int(difference.max()) <= 1
            assert float((difference > 0).float().mean()) < 1e-3
    assert float(quantize_rows_u8(x)[1][5]) == 1.0


def test_the_full_rounding_is_compressed_tensors_own(monkeypatch):
    """rounding="full" - what a W8A8 checkpoint's layers use - quantizes each token as
    compressed-tensors does (max|x| / 127.5, a true division, half to even, -128..127):
    the dequantized rows equal its fake quantization exactly, in the native kernel and
    the PyTorch ops; a row whose largest magnitude is negative may land on -128 (x / scale
    is -127.5 there, or a hair above), which the int8 mode's own rounding never uses."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    import tokenmill.engine.kernels.quantize as module

    args = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True)
    x = torch.randn(1, 64, 200, generator=torch.Generator().manual_seed(11)) * 4
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(1, 1))
    theirs = fake_quantize(x, scale, zero, args)[0]
    for native in (True, False):
        if not native:
            monkeypatch.setattr(module, "_library", lambda: None)
        qx, x_scales = quantize_rows_u8(x[0], None, FULL_RANGE, "full")
        assert torch.equal((qx.float() - FULL_RANGE[1]) * x_scales[:, None], theirs), native
        assert int((qx.amin(1) == 0).sum()) > 10  # rows at -128
        assert int(quantize_rows_u8(x[0])[0].min()) >= 1  # the int8 mode's: -127 at least


def integer_reference(layer: Int8Linear, qweight, x: torch.Tensor) -> torch.Tensor:
    """What the int8 product is, in float64: (qx - zero) @ qw^T * row scale * channel scale."""
    qx, x_scales = quantize_rows_u8(x, layer.inv_smooth, layer.value_range)
    acc = (qx.double() - layer.value_range[1]) @ qweight.double().t()
    return acc * x_scales.double()[:, None] * layer.scale.double()[None, :]


def kernels_here() -> list[str]:
    """The int8 kernels this machine runs: oneDNN always, ours where it is built."""
    return ["onednn", *(["native"] if native_int8_isa() else [])]


@pytest.mark.parametrize("kernel", ["native", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_int8_product_is_exact_and_close_to_float(kernel, dtype, rows, cpu_path):
    if kernel not in kernels_here():  # an AVX2-only CPU: the layer must not pick it
        assert choose_kernel(96, 160) == "onednn"
        cpu_path("int8 linear, native kernel", "not built for this CPU (oneDNN instead)")
        return
    torch.manual_seed(rows)
    weight = torch.randn(96, 160) * 0.05
    bias = torch.randn(96)
    smooth = torch.rand(160) + 0.5
    layer = Int8Linear.from_float(weight, bias.to(dtype), smooth, kernel=kernel)
    assert layer.kernel == kernel
    qweight, _ = quantize_weight(weight * smooth[None, :])
    x = torch.randn(rows, 160).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    exact = integer_reference(layer, qweight, x) + bias.to(dtype).double()
    # Integer accumulation is exact; only the output's rounding differs.
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), exact, rtol=tolerance, atol=tolerance)
    # Against the float product: int8 weights and activations cost ~1% here.
    want = x.double() @ weight.double().t() + bias.to(dtype).double()
    relative = float((got.double() - want).norm() / want.norm())
    assert relative < 0.02


_CHILD = """
import json, torch
from tokenmill.engine.kernels.quantize import quantize_rows_u8
from tokenmill.engine.quant.int8 import Int8Linear, kernel_name, padded_rows, quantize_weight
torch.manual_seed(0)
weight, x = torch.randn(64, 128), torch.randn(8, 128) * 3
layer = Int8Linear.from_float(weight, kernel="onednn")
y = layer(x)
qmax, zero = layer.value_range
qx, x_scales = quantize_rows_u8(x, None, layer.value_range)
exact = ((qx.double() - zero) @ quantize_weight(weight)[0].double().t()) * x_scales.double()[:, None]
exact = exact * layer.scale.double()[None, :]
error = float(((y.double() - exact).abs() / exact.abs().clamp(min=1e-3)).max())
want = x.double() @ weight.double().t()
relative = float((y.double() - want).norm() / want.norm())
print("RESULT " + json.dumps({"kernel": kernel_name(), "qmax": qmax, "exact_error": error,
                              "float_error": relative}))
"""


def run_child(env_overrides: dict[str, str]) -> tuple[dict, str]:
    env = {**os.environ, "ONEDNN_VERBOSE": "1", **env_overrides}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    matmuls = [x for x in done.stdout.splitlines() if ",exec,cpu,matmul," in x]
    return json.loads(line.removeprefix("RESULT ")), matmuls[-1]


def test_onednn_fast_path_where_the_cpu_has_it_and_the_avx2_fallback():
    """oneDNN's int8 matmul (the layers' kernel wherever ours is not built): each path computes its quantized product exactly (no int16 saturation) and stays
    close to the float product; the fallback quantizes activations to 7 bits."""
    fast, fast_impl = run_child({})
    slow, slow_impl = run_child({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    print(
        f"\ndefault: {fast['kernel']} -> {fast_impl.split(',')[6]}; "
        f"capped at AVX2: {slow['kernel']} -> {slow_impl.split(',')[6]}"
    )
    assert slow["kernel"] == "avx2" and slow["qmax"] == 63
    assert "avx512" not in slow_impl and "vnni" not in slow_impl
    if fast["kernel"] in ("avx512_core_vnni", "avx512_core_amx"):
        assert fast["kernel"].removeprefix("avx512_core_") in fast_impl and fast["qmax"] == 127
    for result in (fast, slow):
        assert result["exact_error"] < 1e-4
        assert result["float_error"] < (0.02 if result["qmax"] == 127 else 0.04)
    assert kernel_name() == fast["kernel"]


def test_row_counts_are_padded_to_few_shapes():
    assert [padded_rows(n) for n in (1, 8, 9, 17, 32, 33, 64, 65, 2048, 2049)] == [
        8, 8, 16, 32, 32, 64, 64, 128, 2048, 2112,
    ]  # fmt: skip
    # 8, 16, 32 and the 32 multiples of 64 up to 2,048.
    assert len({padded_rows(n) for n in range(1, 2049)}) == 35


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_absmax_is_max_abs_in_any_dtype(dtype, dim):
    """calibrate.absmax (max of max and -min, what smoothing and the weight scales read)
    is max |x| exactly: rows all negative, all zero, mixed."""
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[3], x[:, 4] = 0, -x[:, 4].abs() - 1
    x[7] = -3.0
    want = x.float().abs().amax(dim=dim)
    got = calibrate.absmax(x, dim=dim)
    assert got.dtype == torch.float32 and torch.equal(got, want)
