"""The stage timer sees the engine through its profiling hook alone: installed with
`LLM.set_profiler`, it times the step stages and, when asked, the linear layers."""

from __future__ import annotations

from tokenmill.bench.profile import LINEAR, LM_HEAD, StageTimer, profile_llm
from tokenmill.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_linear_layers_are_timed_only_when_asked_and_hooked_once(bench_model_dir):
    llm = LLM(str(bench_model_dir), dtype="float32", kv_cache_memory=8 << 20)
    plain = StageTimer()
    llm.set_profiler(plain)
    llm.generate([[1, 2, 3, 4]], PARAMS)
    assert plain.calls["forward"] == 4 and plain.calls["sample"] == 4
    assert LINEAR not in plain.calls and LM_HEAD not in plain.calls

    timer = profile_llm(llm)
    llm.set_profiler(timer)  # installed again: its hooks are not doubled
    llm.generate([[1, 2, 3, 4]], PARAMS)
    num_linear = sum(1 for _ in timer._hooks) // 2
    assert num_linear > 0
    assert timer.calls[LINEAR] == 4 * (num_linear - 1)  # every layer but the head, a step
    assert timer.calls[LM_HEAD] == 4
    llm.set_profiler(None)  # replaced: its hooks are gone and it hears nothing more
    assert timer._hooks == []
    llm.generate([[1, 2, 3, 4]], PARAMS)
    assert timer.calls[LM_HEAD] == 4
