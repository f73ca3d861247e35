"""A child's run of tokenmill, in-process: the RunResult the harness relies on."""

from __future__ import annotations

from tokenmill.bench.child import run_job
from tokenmill.bench.systems import Job, tokenmill_systems
from tokenmill.bench.workload import load_preset


def test_tokenmill_run_result(bench_model_dir, tmp_path):
    workload = load_preset("smoke", bench_model_dir)
    workload.to_json(tmp_path / "w.json")
    (spec,) = tokenmill_systems(["float32"], {"kv_cache_memory": 8 << 20})
    result = run_job(Job(spec, str(bench_model_dir), str(tmp_path / "w.json")))

    assert result.system == "tokenmill-fp32"
    assert result.wall_s > 0 and result.peak_rss_bytes > 0
    assert result.num_prompt_tokens == 192
    assert result.num_generated_tokens == 48 == sum(result.generated)
    assert result.generated == [8] * 6
    assert [len(ids) for ids in result.output_ids] == [8] * 6
    # Per-request cache hits add up to the engine's own counters (no preemption here).
    assert sum(result.cached_prompt) == result.num_cached_prompt_tokens == 64
    assert sum(result.computed_prompt) == result.num_computed_prompt_tokens == 128
    assert all(0 < t <= result.wall_s for t in result.ttft_s)
    assert all(t >= 0 for t in result.tpot_s)
    assert result.extra["num_preemptions"] == 0


def test_a_childs_peak_rss_is_its_own_not_its_parents():
    # The harness may hold GBs when it starts a child (a model converted, a GGUF
    # written); ru_maxrss would hand that figure down across fork and exec.
    import subprocess
    import sys

    script = (
        "import subprocess, sys\n"
        "held = bytearray(400 << 20)\n"
        "held[::4096] = b'1' * len(held[::4096])\n"
        "print(subprocess.run([sys.executable, '-c', 'from tokenmill.bench.result import "
        "peak_rss_bytes; print(peak_rss_bytes())'], capture_output=True, text=True,"
        " check=True).stdout)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert int(done.stdout.split()[0]) < 200 << 20
