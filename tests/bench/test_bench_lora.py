"""The `lora8` preset's pieces on a tiny model: its workload, random PEFT adapters, the
merge-per-adapter baseline, and the three tokenmill systems a LoRA workload runs."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.bench.child import run_job
from tokenmill.bench.lora import make_adapters
from tokenmill.bench.systems import Job, counterparts, tokenmill_systems
from tokenmill.bench.workload import (
    PRESETS,
    build_workload,
    load_preset,
    ordinary_token_ids,
)


def test_lora8_spreads_mixed64_over_eight_adapters(bench_model_dir):
    workload = load_preset("lora8", bench_model_dir)
    mixed = load_preset("mixed64", bench_model_dir)
    assert workload.prompt_ids == mixed.prompt_ids
    assert workload.adapters == [i % 8 for i in range(64)]
    assert mixed.adapters is None


def test_lora_systems_agree_with_merging_each_adapter(bench_model_dir, tmp_path):
    spec = replace(PRESETS["smoke"], num_adapters=3, adapter_rank=4)
    workload = build_workload(spec, ordinary_token_ids(bench_model_dir / "tokenizer.json"))
    workload.to_json(tmp_path / "w.json")
    adapters = [
        str(p) for p in make_adapters(bench_model_dir, tmp_path, num_adapters=3, rank=4, b_std=1.0)
    ]
    specs = tokenmill_systems(["float32"], {"kv_cache_memory": 8 << 20}, lora_adapters=adapters)
    assert [s.label for s in specs] == [
        "tokenmill-fp32-merged",
        "tokenmill-fp32-lora",
        "tokenmill-fp32",
    ]
    merged, mixed, base = specs
    assert [o.label for o in counterparts(mixed, specs)] == [merged.label, base.label]

    results = {
        s.label: run_job(Job(s, str(bench_model_dir), str(tmp_path / "w.json"))) for s in specs
    }
    # Serving each request's adapter in one call computes what merging it does (fp32).
    assert results[mixed.label].output_ids == results[merged.label].output_ids
    assert results[mixed.label].output_ids != results[base.label].output_ids
    assert results[merged.label].extra["num_merges"] == 3
    # The adapters are read and in their slots before the clock, as the model is loaded.
    assert results[mixed.label].extra["adapter_load_s"] > 0
    assert results[mixed.label].extra["timed_slot_loads"] == 0
    for result in results.values():
        assert result.generated == [8] * 6
