"""Bandwidth beside FLOPs: the decode step's two bounds on exact numbers, the batch where
one gives way to the other, decode steps told apart from prefill steps, and the report's
rows for a run."""

from __future__ import annotations

import pytest

from tokenmill.bench.bandwidth import (
    MIN_BUFFER_BYTES,
    Bandwidth,
    DecodeStepTimer,
    crossover_batch,
    decode_bound,
    kv_bytes_per_token,
    largest_cache_bytes,
    measure_bandwidth,
    probe_buffer_bytes,
    weight_bytes,
)
from tokenmill.bench.flops import ModelShape
from tokenmill.bench.report import summarize_system
from tokenmill.bench.result import RunResult
from tokenmill.bench.systems import SystemSpec
from tokenmill.bench.table import prefill_lines
from tokenmill.bench.workload import Workload

SHAPE = ModelShape(
    hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
    head_dim=2, vocab_size=10,
)  # fmt: skip
# per layer: q,o 16 each, k,v 8 each, mlp 72: 120; two layers 240.
P_LAYERS = 240


def test_decode_bound_counts_weights_once_and_kv_per_sequence():
    assert SHAPE.layer_matmul_params == P_LAYERS
    assert weight_bytes(SHAPE, 2.0, 2.0) == 2 * P_LAYERS + 2 * 4 * 10  # 560
    assert weight_bytes(SHAPE, 0.5, 2.0) == 120 + 80
    assert kv_bytes_per_token(SHAPE, 2.0) == 2 * 2 * 1 * 2 * 2  # K and V, 2 layers: 16
    bound = decode_bound(
        SHAPE, 3, 5, weight_bytes_read=560, kv_bytes=2.0, read_gbs=1e-6, peak_gflops=1e-6
    )
    assert bound.bytes_read == 560 + 3 * 5 * 16
    # per token: 2*240 + 2*4*10 = 560; attention 4*2*2*5*2 = 160
    assert bound.flops == 3 * (560 + 160)
    assert bound.memory_s == pytest.approx(800 / 1e3)
    assert bound.compute_s == pytest.approx(2160 / 1e3)
    assert bound.bound == "compute" and bound.share is None


def test_crossover_is_the_first_compute_bound_batch():
    # 1 byte/ns of bandwidth against 10 FLOP/ns; context 1: a step reads 560 + 16*b
    # bytes and computes (560 + 32)*b FLOPs, so bytes > FLOPs/10 up to b = 12.
    args = dict(weight_bytes_read=560, kv_bytes=2.0, read_gbs=1.0, peak_gflops=10.0)
    assert [decode_bound(SHAPE, b, 1, **args).bound for b in (1, 12, 13)] == [
        "memory",
        "memory",
        "compute",
    ]
    assert crossover_batch(SHAPE, 1, **args) == 13
    # At context 5 each sequence reads 80 bytes of KV and computes 72 FLOP-ns: never.
    assert crossover_batch(SHAPE, 5, **args, largest=1000) is None


class _Stats:
    def __init__(self, prompt: int, generated: int, experts: int = 0) -> None:
        self.computed_prompt_tokens = prompt
        self.generated_tokens = generated
        self.moe_experts_used = experts


def test_step_timer_keeps_pure_decode_steps_by_batch(monkeypatch):
    import tokenmill.bench.bandwidth as bandwidth

    clock = iter([0.0, 1.0, 1.5, 1.75, 2.0, 2.5, 4.0])
    monkeypatch.setattr(bandwidth.time, "perf_counter", lambda: next(clock))
    timer = DecodeStepTimer()
    timer.start(_Stats(0, 0))
    # prefill (prompt computed), decode of 3, decode of 3, chunked prefill beside a
    # decode of 2 (prompt computed: left out), decode of 2, a step that sampled nothing.
    for stats in [(64, 3), (64, 6), (64, 9), (96, 11), (96, 13), (96, 13)]:
        timer(_Stats(*stats))
    assert timer.summary() == {
        2: {"num_steps": 1, "mean_s": 0.5},
        3: {"num_steps": 2, "mean_s": 0.375},
    }
    # the two steps that computed prompt tokens: 1.0 s (64 tokens) and 0.25 s (32)
    assert timer.prefill_summary() == {"num_steps": 2, "seconds": 1.25, "num_tokens": 96}


def test_bandwidth_is_measured_both_ways():
    measured = measure_bandwidth(buffer_bytes=1 << 22, num_trials=2)
    assert isinstance(measured, Bandwidth)
    assert measured.read_gbs > 0.1 and measured.triad_gbs > 0.1


def test_report_rows_per_batch_size_for_a_bf16_run():
    workload = Workload("w", [[1, 2, 3], [1, 2, 4, 5, 6]], [4, 2], [None, None], [0, 0])
    run = RunResult(
        system="tokenmill-bf16", wall_s=1.0, num_prompt_tokens=8,
        num_computed_prompt_tokens=8, num_cached_prompt_tokens=0, num_generated_tokens=6,
        computed_prompt=[3, 5], cached_prompt=[0, 0], generated=[4, 2], ttft_s=[0.1, 0.1],
        tpot_s=[0.01, 0.01], peak_rss_bytes=1, cpu_s=1.0,
        # as the child's JSON brings them back: batch sizes as strings
        extra={"decode_steps": {"2": {"num_steps": 1, "mean_s": 2e-6},
                                "1": {"num_steps": 2, "mean_s": 1e-6}}},
    )  # fmt: skip
    spec = SystemSpec("tokenmill-bf16", "tokenmill", "bfloat16", False, {})
    summary = summarize_system(
        spec, [run], workload=workload, shape=SHAPE, peak_gflops=1.0, read_gbs=1.0
    )
    # mean context: (3 + 2) and (5 + 1) -> 5.5, rounded to 6 (banker's: round(5.5) = 6)
    rows = [(r["batch"], r["context"], r["bytes_read"], r["flops"]) for r in summary.decode]
    assert rows == [(1, 6, 560 + 96, 560 + 192), (2, 6, 560 + 192, 2 * (560 + 192))]
    first = summary.decode[0]
    assert first["bound"] == "compute"  # 752 FLOP-ns > 656 byte-ns
    assert first["share"] == pytest.approx(752e-9 / 1e-6)
    assert (
        summarize_system(spec, [run], workload=workload, shape=SHAPE, peak_gflops=1.0).decode == []
    )


# A mixture of experts: 2 sparse layers of 4 experts, 2 a token, each expert 3 wide.
MOE_SHAPE = ModelShape(
    hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
    head_dim=2, vocab_size=10, num_experts=4, experts_per_token=2,
    expert_intermediate_size=3, num_sparse_layers=2,
)  # fmt: skip
# per layer: attention 48, router 16, each expert 3 * 4 * 3 = 36.


def test_step_timer_keeps_the_experts_each_decode_step_ran(monkeypatch):
    import tokenmill.bench.bandwidth as bandwidth

    clock = iter([0.0, 1.0, 1.5, 1.75, 2.0])
    monkeypatch.setattr(bandwidth.time, "perf_counter", lambda: next(clock))
    timer = DecodeStepTimer()
    timer.start(_Stats(0, 0, 0))
    # prefill (8 experts: left out), then decodes of 2 rows running 5, 6 and 3 experts
    for stats in [(64, 2, 8), (64, 4, 13), (64, 6, 19), (64, 8, 22)]:
        timer(_Stats(*stats))
    assert timer.summary() == {
        2: {"num_steps": 3, "mean_s": pytest.approx(1 / 3), "mean_experts_used": 14 / 3}
    }


def test_moe_decode_rows_read_the_experts_counted_not_the_estimate():
    """The engine counted 5 experts a step (2.5 a layer) at batch 2: the bytes are those
    experts' and the row says they were counted; without a count, uniform routing's
    4 * (1 - (1/2)^2) = 3 a layer, marked as the estimate."""
    counted = 2 * 48 + 2 * (16 + 2.5 * 36)  # 308 weights
    assert weight_bytes(MOE_SHAPE, 2.0, 2.0, 2, experts_used=5) == 2 * counted + 2 * 40
    assert weight_bytes(MOE_SHAPE, 2.0, 2.0, 2) == 2 * (2 * 48 + 2 * (16 + 3 * 36)) + 80
    workload = Workload("w", [[1, 2], [3, 4]], [2, 2], [None, None], [0, 0])
    steps = {"2": {"num_steps": 1, "mean_s": 1e-6, "mean_experts_used": 5.0}}
    run = RunResult(
        system="tokenmill-bf16", wall_s=1.0, num_prompt_tokens=4,
        num_computed_prompt_tokens=4, num_cached_prompt_tokens=0, num_generated_tokens=4,
        computed_prompt=[2, 2], cached_prompt=[0, 0], generated=[2, 2], ttft_s=[0.1, 0.1],
        tpot_s=[0.01, 0.01], peak_rss_bytes=1, cpu_s=1.0, extra={"decode_steps": steps},
    )  # fmt: skip
    spec = SystemSpec("tokenmill-bf16", "tokenmill", "bfloat16", False, {})
    kv = 3 * kv_bytes_per_token(MOE_SHAPE, 2.0)  # 2 rows at context 3 (2 + 2 / 2): 96
    (row,) = summarize_system(
        spec, [run], workload=workload, shape=MOE_SHAPE, peak_gflops=1.0, read_gbs=1.0
    ).decode
    assert row["bytes_read"] == 2 * counted + 80 + 2 * kv
    assert (row["experts_per_layer"], row["experts_source"]) == (2.5, "counted")
    del steps["2"]["mean_experts_used"]
    (row,) = summarize_system(
        spec, [run], workload=workload, shape=MOE_SHAPE, peak_gflops=1.0, read_gbs=1.0
    ).decode
    assert row["bytes_read"] == 2 * (2 * 48 + 2 * (16 + 3 * 36)) + 80 + 2 * kv
    assert (row["experts_per_layer"], row["experts_source"]) == (3.0, "uniform")


def test_prefill_share_counts_computed_prompt_tokens_causally():
    """Prefill's share of the compute roofline: the computed prompt tokens' FLOPs over the
    prefill steps' seconds, a cached prefix's positions counted as context only."""
    workload = Workload("w", [[1, 2, 3], [1, 2, 4, 5, 6]], [4, 2], [None, None], [0, 0])
    run = RunResult(
        system="tokenmill-bf16", wall_s=1.0, num_prompt_tokens=8,
        num_computed_prompt_tokens=6, num_cached_prompt_tokens=2, num_generated_tokens=6,
        computed_prompt=[3, 3], cached_prompt=[0, 2], generated=[4, 2], ttft_s=[0.1, 0.1],
        tpot_s=[0.01, 0.01], peak_rss_bytes=1, cpu_s=1.0,
        extra={"prefill_steps": {"num_steps": 2, "seconds": 4e-6, "num_tokens": 6}},
    )  # fmt: skip
    spec = SystemSpec("tokenmill-bf16", "tokenmill", "bfloat16", False, {})
    summary = summarize_system(spec, [run], workload=workload, shape=SHAPE, peak_gflops=1.0)
    # first request: positions 0-2, 2*240*3 linear + 2*4*10 lm_head + 16 * (1+2+3) * 2
    # layers attention = 1712; second: positions 2-4 after 2 cached, 1440 + 80 +
    # 16 * (3+4+5) * 2 = 1904. 3616 FLOPs in 4 us at 1 GFLOP/s.
    assert summary.prefill_s == 4e-6
    assert summary.prefill_roofline == pytest.approx(3616 / 4e-6 / 1e9)
    assert prefill_lines([summary]) == [
        "tokenmill-bf16: prefill steps 0.00 s, 90% of the compute roofline (attention "
        "causal; decode rows beside prompt chunks not counted)"
    ]


def test_probe_buffers_are_four_times_the_largest_cache(tmp_path):
    # Emerald Rapids' caches as sysfs lists them: a 256 MB buffer would fit in its L3.
    for index, size in enumerate(["48K", "32K", "2048K", "307200K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 307200 << 10
    assert probe_buffer_bytes(tmp_path) == 4 * (307200 << 10)


def test_probe_buffers_keep_their_floor_where_sysfs_is_silent_or_small(tmp_path):
    assert largest_cache_bytes(tmp_path) == 0
    assert probe_buffer_bytes(tmp_path) == MIN_BUFFER_BYTES
    (tmp_path / "index0").mkdir()
    (tmp_path / "index0" / "size").write_text("8M")
    assert probe_buffer_bytes(tmp_path) == MIN_BUFFER_BYTES  # 32 MB is under the floor
    (tmp_path / "index1").mkdir()
    (tmp_path / "index1" / "size").write_text("")
    assert largest_cache_bytes(tmp_path) == 8 << 20
