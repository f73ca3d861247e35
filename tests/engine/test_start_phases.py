"""`LLM.start_phases`: each phase of a start timed once, in order, adding up to the start."""

from __future__ import annotations

import time

import pytest
from hf_models import build_hf_model, save_char_tokenizer

from tokenmill import LLM
from tokenmill.engine.types import start_phases
from tokenmill.engine.types.start_phases import StartPhases

# A decoder's phases, in the order its start runs them (types/start_phases.py).
DECODER_PHASES = [
    "resolve", "tokenizer", "checks", "plan", "quantize", "load", "pack", "kv_cache",
    "runner", "engine",
]  # fmt: skip


class _Clock:
    """perf_counter that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_phase_timed_inside_a_lap_is_counted_once_under_its_own_name(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(start_phases.time, "perf_counter", clock)
    phases = StartPhases()
    clock.now += 1.0
    phases.lap("tokenizer")
    clock.now += 2.0  # load reads
    with phases.phase("quantize"):
        clock.now += 3.0
    clock.now += 0.5  # load reads again
    with phases.phase("quantize"):
        clock.now += 0.25
    phases.lap("load")
    clock.now += 4.0
    phases.lap("pack")
    assert phases.seconds == {"tokenizer": 1.0, "quantize": 3.25, "load": 2.5, "pack": 4.0}
    assert list(phases.seconds) == ["tokenizer", "quantize", "load", "pack"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model(
        "llama", path, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    save_char_tokenizer(path)
    return path


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_an_llm_start_is_split_into_its_phases(model_dir, quantization):
    started = time.perf_counter()
    llm = LLM(model_dir, device="cpu", dtype="bfloat16", quantization=quantization)
    took = time.perf_counter() - started
    phases = llm.start_phases
    assert list(phases) == DECODER_PHASES
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= took
    assert phases["load"] > 0
    if quantization is not None:  # the layers were quantized as the load filled them
        assert phases["quantize"] > 0
