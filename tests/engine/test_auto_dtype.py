"""dtype="auto" on CPU: bf16 only where the CPU multiplies bf16 itself. torch's own check
is True on every AVX-512 BW/VL/DQ CPU, where oneDNN emulates bf16 matmuls; there fp32 is
the faster model dtype, while oneDNN still packs bf16 weights for a model forced to bf16."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kernels import cpu_flags
from tokenmill.engine.quant import packed_linear
from tokenmill.engine.types import config

CPU = torch.device("cpu")


def _cpu(monkeypatch, *, machine: str, onednn_bf16: bool, avx512_bf16: bool, amx: bool):
    monkeypatch.setattr(config.platform, "machine", lambda: machine)
    monkeypatch.setattr(config, "onednn_has_bf16", lambda: onednn_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    ("onednn_bf16", "avx512_bf16", "amx", "want"),
    [
        (True, False, False, torch.float32),  # Ice Lake, Cascade Lake: bf16 emulated
        (True, True, False, torch.bfloat16),  # Zen 4/5, Cooper Lake
        (True, True, True, torch.bfloat16),  # Sapphire / Emerald / Granite Rapids
        (True, False, True, torch.bfloat16),  # AMX tiles without the flag read
        (False, False, False, torch.float32),  # AVX2 only (Zen 1-3), or no oneDNN
        (False, True, True, torch.float32),  # a torch without oneDNN's bf16
    ],
)
def test_auto_is_bf16_only_on_native_bf16_x86(monkeypatch, onednn_bf16, avx512_bf16, amx, want):
    _cpu(monkeypatch, machine="x86_64", onednn_bf16=onednn_bf16, avx512_bf16=avx512_bf16, amx=amx)
    assert config.resolve_dtype("auto", CPU) == want
    assert config.resolve_dtype("bfloat16", CPU) == torch.bfloat16  # a user's choice stands
    assert config.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_other_architectures_keep_torchs_answer(monkeypatch, onednn_bf16):
    _cpu(monkeypatch, machine="aarch64", onednn_bf16=onednn_bf16, avx512_bf16=False, amx=False)
    want = torch.bfloat16 if onednn_bf16 else torch.float32
    assert config.resolve_dtype("auto", CPU) == want


def test_emulated_bf16_still_packs_bf16_weights(monkeypatch):
    # A model forced to bf16 on Ice Lake: the packed weights keep their one-row decode
    # (half fp32's bytes) whatever "auto" would have chosen.
    _cpu(monkeypatch, machine="x86_64", onednn_bf16=True, avx512_bf16=False, amx=False)
    monkeypatch.setattr(packed_linear, "onednn_has_bf16", lambda: True)
    assert not config.cpu_has_fast_bf16()
    assert packed_linear.packs_dtype(torch.bfloat16) == packed_linear.onednn_linear_available()


def test_this_cpu_agrees_with_its_flags():
    flags = cpu_flags()
    if not flags or not config.onednn_has_bf16():
        pytest.skip("no x86 flags to read, or no oneDNN bf16")
    native = "avx512_bf16" in flags or "amx_tile" in flags
    assert config.cpu_has_fast_bf16() == native
    assert (config.resolve_dtype("auto", CPU) == torch.bfloat16) == native
