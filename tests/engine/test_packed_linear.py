"""PackedLinear: oneDNN's linear on a weight packed once, in place of nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.engine.quant.packed_linear import (
    PackedLinear,
    onednn_linear_available,
    pack_linear_layers,
    packs_dtype,
)
from tokenmill.engine.types.config import EngineConfig

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(), reason="this torch build has no oneDNN linear ops"
)


@pytest.fixture(autouse=True)
def _packing_allowed(monkeypatch):
    """These tests are of packing itself: a run with TOKENMILL_PACKED_LINEAR=0 (the rest of
    the suite on F.linear) still checks it."""
    monkeypatch.delenv("TOKENMILL_PACKED_LINEAR", raising=False)


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=True), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(
        dtype
    )


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_layers_compute_what_nn_linear_computes(dtype, tol, cpu_path):
    """Packed where this CPU packs the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT),
    F.linear kept where it does not; the outputs are nn.Linear's either way."""
    model = _mlp(dtype)
    x = torch.randn(37, 64).to(dtype)
    packs = packs_dtype(dtype)
    cpu_path(f"linear {dtype}", "oneDNN packed" if packs else "F.linear (no oneDNN packing)")
    with torch.inference_mode():
        want = model(x).float()
        assert pack_linear_layers(model, dtype=dtype, device=torch.device("cpu")) == 2 * packs
        kinds = {type(model[i]) for i in (0, 2)}
        assert kinds == ({PackedLinear} if packs else {nn.Linear})
        got = model(x).float()
        # A transposed (non-contiguous) input, as a split or a view hands over.
        got_t = model(x.t().contiguous().t()).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_t, want, rtol=tol, atol=tol)


def test_packing_is_skipped_where_it_does_not_apply(monkeypatch):
    model = _mlp(torch.float32)
    assert pack_linear_layers(model, dtype=torch.float32, device=torch.device("cuda")) == 0
    assert pack_linear_layers(model, dtype=torch.float16, device=torch.device("cpu")) == 0
    off = pack_linear_layers(model, dtype=torch.float32, device=torch.device("cpu"), enabled=False)
    assert off == 0
    assert isinstance(model[0], nn.Linear)
    # The setting's default comes from the environment; a given value wins.
    monkeypatch.setenv("TOKENMILL_PACKED_LINEAR", "0")
    assert EngineConfig().packed_linear is False
    assert EngineConfig(packed_linear=True).packed_linear is True


def test_the_engine_runs_packed_layers(tmp_path):
    from hf_models import build_hf_model, make_engine

    build_hf_model("qwen2", tmp_path)  # qkv projections with a bias
    engine = make_engine(tmp_path)
    layers = list(engine.runner.model.modules())
    assert not any(type(m) is nn.Linear for m in layers)  # fp32: packed on every x86 CPU
    assert sum(isinstance(m, PackedLinear) for m in layers) > 0
