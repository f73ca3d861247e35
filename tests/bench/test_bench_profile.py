"""The stage timer sees the engine through its profiling hook alone: installed with
`LLM.set_profiler`, it times the step stages and, when asked, the linear layers."""

from __future__ import annotations

from tokenmill.bench.profile import LINEAR, LM_HEAD, StageTimer, ThreadSplitTimer, profile_llm
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


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_thread_split_timer_charges_each_clock_exclusive_of_nested_stages():
    wall, cpu, main = _Clock(), _Clock(), _Clock()
    timer = ThreadSplitTimer(clocks={"wall": wall, "cpu": cpu, "main": main})

    def spend(w: float, c: float, m: float) -> None:
        wall.now, cpu.now, main.now = wall.now + w, cpu.now + c, main.now + m

    timer.enter("forward")
    spend(1.0, 1.0, 1.0)  # Python: the main thread alone
    timer.enter("experts")
    spend(4.0, 8.0, 4.0)  # both threads busy
    timer.exit()
    spend(0.5, 0.5, 0.5)
    timer.exit()
    assert timer.split() == {
        "wall": {"forward": 1.5, "experts": 4.0},
        "cpu": {"forward": 1.5, "experts": 8.0},
        "main": {"forward": 1.5, "experts": 4.0},
    }
    assert timer.seconds == {"forward": 1.5, "experts": 8.0}  # StageTimer's: the CPU clock
    assert timer.calls == {"forward": 1, "experts": 1}
    timer.reset()
    assert timer.split() == {"wall": {}, "cpu": {}, "main": {}} and not timer.calls


def test_thread_split_timer_stages_add_up_to_the_steps(bench_model_dir):
    llm = LLM(str(bench_model_dir), dtype="float32", kv_cache_memory=8 << 20)
    timer = ThreadSplitTimer(linear_layers=True)
    llm.set_profiler(timer)
    llm.generate([[1, 2, 3, 4]], PARAMS)
    split = timer.split()
    assert set(split) == {"wall", "cpu", "main"}
    assert split["cpu"].keys() == split["main"].keys() == split["wall"].keys()
    assert timer.calls["forward"] == 4 and timer.calls[LM_HEAD] == 4
    # The step's own thread never spends more CPU than the whole process.
    for stage, seconds in split["main"].items():
        assert 0 <= seconds <= split["cpu"][stage] + 1e-3, stage
