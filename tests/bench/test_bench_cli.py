"""`tokenmill bench` end to end on a tiny random model: tokenmill vs HF, one round."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tokenmill.cli import main

SYSTEM_FIELDS = {
    "label", "kind", "dtype", "is_baseline", "num_runs", "wall_s", "total_tok_s", "gen_tok_s",
    "num_prompt_tokens", "num_computed_prompt_tokens", "num_cached_prompt_tokens",
    "num_generated_tokens", "peak_rss_mb", "ttft_s", "tpot_s", "useful_tflop", "executed_tflop",
    "peak_gflops", "roofline", "executed_roofline", "cpu_util", "ratios", "outputs_match",
}  # fmt: skip


# Three child processes (peak, tokenmill, HF), each importing torch: ~10 s on a quiet
# 2-core machine, the bulk of this folder's test time.
def test_bench_smoke_writes_the_report(bench_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(bench_model_dir), "--preset", "smoke", "--baseline", "hf",
            "--dtype", "float32", "--repeat", "1", "--hf-batch-size", "4", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Throughput" in result.output and "tokenmill-fp32" in result.output

    report = json.loads(out.read_text())
    assert report["preset"] == "smoke"
    assert report["workload"]["num_requests"] == 6
    assert report["workload"]["num_prompt_tokens"] == 192
    assert report["workload"]["num_output_tokens"] == 48
    assert set(report["peaks_gflops"]) == {"float32"}
    systems = {s["label"]: s for s in report["systems"]}
    assert set(systems) == {"tokenmill-fp32", "hf-fp32"}
    for summary in systems.values():
        assert set(summary) >= SYSTEM_FIELDS
        assert summary["num_runs"] == 1 and summary["error"] is None
        assert summary["num_generated_tokens"] == 48
        assert summary["peak_rss_mb"] > 0
        assert set(summary["ttft_s"]) == {"p50", "p95", "p99"}
    tokenmill = systems["tokenmill-fp32"]
    assert tokenmill["ratios"].keys() == {"hf-fp32"}
    # The smoke preset's 3 shared prompts share a 2-block prefix: 2 of them hit the cache.
    assert tokenmill["num_cached_prompt_tokens"] == 64
    assert tokenmill["num_computed_prompt_tokens"] == 128
    # HF computes left padding too: batches of 4 then 2 length-sorted prompts.
    assert systems["hf-fp32"]["num_computed_prompt_tokens"] > 192
    # Greedy fp32 on the same weights: HF agrees with tokenmill on every request.
    assert systems["hf-fp32"]["outputs_match"] == "6/6 vs tokenmill-fp32"
    assert [r["system"] for r in report["runs"]] == ["tokenmill-fp32", "hf-fp32"]


# Two child processes (peak, tokenmill): the caps reach the runs, not only the report.
def test_bench_rows_and_output_caps_reach_every_run(bench_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(bench_model_dir), "--preset", "smoke", "--baseline", "none",
            "--dtype", "float32", "--rows", "4", "--max-output-tokens", "3", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "capped: first rows 4, output tokens at most 3" in result.output

    report = json.loads(out.read_text())
    workload = report["workload"]
    assert (workload["num_requests"], workload["num_output_tokens"]) == (4, 12)
    assert workload["spec"]["rows_cap"] == 4 and workload["spec"]["output_tokens_cap"] == 3
    (tokenmill,) = report["systems"]
    assert tokenmill["num_generated_tokens"] == 12 and tokenmill["error"] is None


def test_bench_caps_are_refused_for_an_embedding_preset():
    args = ["bench", "--preset", "embed-smoke", "--rows", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "cap the generation presets only, not embed-smoke" in result.output
