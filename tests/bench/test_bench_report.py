"""The report's arithmetic on synthetic numbers: percentiles, FLOPs, roofline, ratios."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tokenmill.bench.flops import (
    ModelShape,
    RequestWork,
    minimal_works,
    request_flops,
    total_flops,
)
from tokenmill.bench.report import (
    agreeing_prefix_lengths,
    build_summaries,
    paired_ratio,
    roofline_fraction,
    summarize_system,
    useful_flops,
)
from tokenmill.bench.result import RunResult, tpot
from tokenmill.bench.stats import Percentiles, median, percentile
from tokenmill.bench.systems import SystemSpec
from tokenmill.bench.workload import Workload

SHAPE = ModelShape(
    hidden_size=4,
    intermediate_size=6,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    vocab_size=10,
)


def test_percentile_matches_numpy_linear():
    values = [0.3, 1.0, 7.5, 2.2, 9.9, 4.0, 0.1]
    for q in (0, 1, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([5.0], 99) == 5.0
    assert median([1, 2, 3, 4]) == 2.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentiles_median_over_runs():
    runs = [Percentiles(1, 2, 3), Percentiles(2, 4, 6), Percentiles(10, 20, 30)]
    assert Percentiles.median_of(runs) == Percentiles(2, 4, 6)
    assert Percentiles.of(list(range(101))) == Percentiles(50, 95, 99)


def test_layer_matmul_params():
    # per layer: q,o 4*2*2 each, k,v 4*1*2 each, mlp 3*4*6
    assert SHAPE.layer_matmul_params == 2 * (2 * 16 + 2 * 8 + 72)


def _brute_force_flops(shape: ModelShape, work: RequestWork) -> int:
    """Token by token: every fed token pays the layer matmuls and attends to its context."""
    flops = 0
    num_fed = work.num_computed_prompt + work.num_generated - 1
    for position in range(work.num_cached_prompt, work.num_cached_prompt + num_fed):
        flops += 2 * shape.layer_matmul_params
        for layer in range(shape.num_layers):
            context = position + 1
            if layer < shape.num_window_layers:
                context = min(context, shape.sliding_window)
            flops += shape.num_heads * (2 * shape.head_dim * context) * 2
    return flops + work.num_generated * 2 * shape.hidden_size * shape.vocab_size


# Gemma 3-like: one of two layers attends within a 4-token window.
WINDOWED = dataclasses.replace(SHAPE, sliding_window=4, num_window_layers=1)


@pytest.mark.parametrize("shape", [SHAPE, WINDOWED])
@pytest.mark.parametrize(
    "work", [RequestWork(5, 0, 3), RequestWork(7, 16, 1), RequestWork(1, 3, 9)]
)
def test_request_flops_formula(shape, work):
    assert request_flops(shape, work) == _brute_force_flops(shape, work)


def test_window_layers_from_a_gemma3_config(tmp_path):
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "sliding_window": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_dir(tmp_path)
    assert (shape.sliding_window, shape.num_window_layers, shape.head_dim) == (512, 10, 256)


def test_request_flops_exact_value():
    # 4 prompt tokens, 2 generated: 5 tokens fed, contexts 1..5, 2 logit rows.
    linear = 2 * 240 * 5
    attention = 4 * 2 * 2 * 2 * (1 + 2 + 3 + 4 + 5)
    lm_head = 2 * 4 * 10 * 2
    assert request_flops(SHAPE, RequestWork(4, 0, 2)) == linear + attention + lm_head == 3040


def test_minimal_works_compute_each_prefix_once():
    works = minimal_works([10, 12, 5, 11], [2, 2, 2, 2], [0, 0, None, 1], [8, 8, 0, 8])
    assert works == [
        RequestWork(10, 0, 2),
        RequestWork(4, 8, 2),
        RequestWork(5, 0, 2),
        RequestWork(11, 0, 2),
    ]
    assert total_flops(SHAPE, works) == sum(request_flops(SHAPE, w) for w in works)


def test_roofline_fraction():
    assert roofline_fraction(100e9, 2.0, 100.0) == 0.5


def test_tpot():
    assert tpot(1.0, 4.0, 4) == 1.0
    assert tpot(1.0, 1.0, 1) == 0.0


def _run(label: str, wall: float, outputs=None, computed=(3, 3), cached=(0, 0)) -> RunResult:
    return RunResult(
        system=label,
        wall_s=wall,
        num_prompt_tokens=6,
        num_computed_prompt_tokens=sum(computed),
        num_cached_prompt_tokens=sum(cached),
        num_generated_tokens=4,
        computed_prompt=list(computed),
        cached_prompt=list(cached),
        generated=[2, 2],
        ttft_s=[0.1, 0.3],
        tpot_s=[0.01, 0.03],
        peak_rss_bytes=100 * 2**20,
        cpu_s=wall * 2,
        output_ids=outputs,
    )


WORKLOAD = Workload("w", [[1, 2, 3], [1, 2, 4]], [2, 2], [0, 0], [2, 2])


def test_paired_ratio_is_the_median_of_within_round_ratios():
    system = [_run("a", 1.0), _run("a", 2.0), _run("a", 1.0), None]
    baseline = [_run("b", 3.0), _run("b", 2.0), _run("b", 4.0), _run("b", 1.0)]
    # rounds 1-3: 3x, 1x, 4x; round 4 failed on one side and is left out.
    assert paired_ratio(system, baseline) == 3.0
    assert paired_ratio([None], [_run("b", 1.0)]) is None


def test_summarize_system():
    spec = SystemSpec("a", "tokenmill", "float32", is_baseline=False)
    runs = [_run("a", 2.0), None, _run("a", 1.0), _run("a", 4.0)]
    s = summarize_system(spec, runs, workload=WORKLOAD, shape=SHAPE, peak_gflops=1e-6)
    assert s.num_runs == 3
    assert s.wall_s == 2.0
    assert s.total_tok_s == 10 / 2.0
    assert s.gen_tok_s == 4 / 2.0
    assert s.peak_rss_mb == 100
    assert s.cpu_util == 2.0
    assert s.ttft_s == Percentiles(0.2, pytest.approx(0.29), pytest.approx(0.298))
    useful = useful_flops(WORKLOAD, SHAPE)
    # The second request reuses the 2-token shared prefix.
    assert useful == request_flops(SHAPE, RequestWork(3, 0, 2)) + request_flops(
        SHAPE, RequestWork(1, 2, 2)
    )
    assert s.useful_tflop == useful / 1e12
    executed = 2 * request_flops(SHAPE, RequestWork(3, 0, 2))
    assert s.executed_tflop == executed / 1e12
    assert s.roofline == pytest.approx(useful / 2.0 / 1e3)
    assert s.executed_roofline == pytest.approx(executed / 2.0 / 1e3)


def test_summarize_failed_system():
    spec = SystemSpec("a", "hf", "float32", is_baseline=True)
    s = summarize_system(
        spec, [None], workload=WORKLOAD, shape=SHAPE, peak_gflops=1.0, error="boom"
    )
    assert s.num_runs == 0 and s.wall_s is None and s.error == "boom"


def test_build_summaries_ratios_and_agreement():
    specs = [
        SystemSpec("tm-bf16", "tokenmill", "bfloat16", False),
        SystemSpec("tm-fp32", "tokenmill", "float32", False),
        SystemSpec("hf", "hf", "float32", True),
    ]
    runs = {
        "tm-bf16": [_run("tm-bf16", 1.0, [[1, 2], [3, 5]])],
        "tm-fp32": [_run("tm-fp32", 2.0, [[1, 2], [3, 4]])],
        "hf": [_run("hf", 6.0, [[1, 2], [3, 4]])],
    }
    summaries = build_summaries(
        specs, runs, {}, workload=WORKLOAD, shape=SHAPE, peaks_gflops={"float32": 1.0}
    )
    by_label = {s.label: s for s in summaries}
    assert by_label["tm-bf16"].ratios == {"hf": 6.0}
    assert by_label["tm-fp32"].ratios == {"hf": 3.0}
    assert by_label["hf"].ratios == {}
    # tokenmill fp32 is the reference for greedy agreement.
    assert by_label["tm-fp32"].outputs_match is None
    assert by_label["tm-bf16"].outputs_match == "1/2 vs tm-fp32"
    assert by_label["hf"].outputs_match == "2/2 vs tm-fp32"
    assert by_label["tm-bf16"].mean_agreeing_tokens == 1.5  # [1, 2] and [3, 5] vs [3, 4]
    assert by_label["hf"].mean_agreeing_tokens == 2.0
    # No bf16 peak measured: no roofline for that system.
    assert by_label["tm-bf16"].roofline is None
    assert by_label["tm-fp32"].roofline is not None


def test_agreeing_prefix_lengths():
    outputs = [[1, 2, 3], [4], [], [7, 8]]
    reference = [[1, 2, 4], [4], [1], [7, 8]]
    assert agreeing_prefix_lengths(outputs, reference) == [2, 1, 0, 2]


def test_kv_cache_variants_are_compared_with_their_plain_and_default_cache_runs():
    """--kv-cache-dtype auto,int8 runs every tokenmill system twice; an int8-cache run is
    compared with the plain float run, the same system on the default cache and (when
    quantized) the unquantized run on the same cache - nothing else. The float runs are at
    the dtype quantized ones run beside (the CPU's best: bf16 or fp32)."""
    from tokenmill.bench.systems import (
        DTYPE_SHORT,
        best_float_dtype,
        counterparts,
        tokenmill_systems,
    )

    dtype = best_float_dtype()
    plain = f"tokenmill-{DTYPE_SHORT[dtype]}"
    specs = tokenmill_systems([dtype], {"seed": 1}, ["int8"], kv_cache_dtypes=["auto", "int8"])
    labels = [s.label for s in specs]
    assert labels == [plain, "tokenmill-int8", f"{plain}-kv8", "tokenmill-int8-kv8"]
    assert specs[3].options["engine_args"] == {
        "seed": 1,
        "quantization": "int8",
        "kv_cache_dtype": "int8",
    }
    compared = {s.label: [c.label for c in counterparts(s, specs)] for s in specs}
    assert compared == {
        plain: [],
        "tokenmill-int8": [plain],
        f"{plain}-kv8": [plain],
        "tokenmill-int8-kv8": [plain, f"{plain}-kv8", "tokenmill-int8"],
    }


def test_a_quantized_checkpoint_is_compared_with_the_float_run_and_each_mode():
    """--checkpoint DIR runs the directory as stored beside the modes: compared with the
    plain float run and every --quantization mode, and nothing compares with it."""
    from tokenmill.bench.systems import best_float_dtype, counterparts, tokenmill_systems

    specs = tokenmill_systems(
        [best_float_dtype()], {"seed": 1}, ["int4", "int8"], checkpoints=["/ckpt/W4A16_G64"]
    )
    checkpoint = specs[-1]
    assert checkpoint.label == "tokenmill-ckpt-W4A16_G64"
    assert checkpoint.options["model"] == "/ckpt/W4A16_G64"
    assert checkpoint.options["engine_args"] == {"seed": 1}
    compared = {s.label: [c.label for c in counterparts(s, specs)] for s in specs}
    plain = specs[0].label
    assert compared[checkpoint.label] == [plain, "tokenmill-int4", "tokenmill-int8"]
    assert all(
        checkpoint.label not in c for label, c in compared.items() if label != checkpoint.label
    )
