"""Where a mixture-of-experts model's step time goes: prefill and decode at a few batch
sizes, split into the router, the experts' one grouped call (sort, gather, gate_up, the
activation, down and the weighted sum back into token order), attention, the dense
linear layers and the lm_head, beside each regime's bound. Times are CPU seconds of the
process (all its threads), so a busy machine's other work does not count; on a quiet one
divide by the threads for wall time.

`--wall` adds each stage's main-thread CPU and how far it exceeds the all-thread CPU /
threads: the time one thread works while the others wait (Python, torch ops that do not
split, uneven splits). Run it with OMP_WAIT_POLICY=PASSIVE, so that a waiting thread
sleeps instead of spinning (a spin counts as CPU and hides the wait) - which holds on a
busy machine too, where wall time does not. (A thread's CPU reaches the process's count
up to a scheduler tick late: trust the split of stages of a millisecond or more.)

    python benchmarks/moe_step.py --model DIR --dtype bfloat16 --quantization int8
    TOKENMILL_CACHE_DIR=... python benchmarks/moe_step.py --shape olmoe-1b-7b --layers 4

Prefill is `--prefill-rows` prompts of `--prefill-tokens` random token ids and one output
token; decode is `--batches` rows of `--decode-prompt-tokens`-token prompts, timed as the
difference between `--decode-steps` + 1 output tokens and one, the prompts prefix-cached
before either (so the prompts' step cancels). The bound of a
decode step is the bytes of the experts its layers ran (the engine's count,
EngineStats.moe_experts_used) and the dense weights over the read bandwidth; of prefill, the active FLOPs over the
matmul peak - both measured in the same run (tokenmill.bench).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.bandwidth import measure_bandwidth
from tokenmill.bench.flops import (
    ModelShape,
    RequestWork,
    llm_matmul_shapes,
    measure_matmul_peak,
    total_flops,
)
from tokenmill.bench.profile import ThreadSplitTimer

ROUTER, EXPERTS = "router", "experts (one call)"


class MoeStageTimer(ThreadSplitTimer):
    """ThreadSplitTimer plus the MoE blocks' router and experts as stages, and one
    expert's bytes (to turn the engine's count of experts run into the bytes a step must
    read)."""

    def __init__(self) -> None:
        super().__init__(linear_layers=True)
        self.expert_bytes = 0.0  # one expert's packed weights

    def watch(self, model) -> None:
        super().watch(model)
        if model is None:
            return
        for module in model.modules():
            name = type(module).__name__
            if name == "Router":
                self._hooks.append(module.register_forward_pre_hook(self._pre(ROUTER)))
                self._hooks.append(module.register_forward_hook(self._post))
            elif name.endswith("Experts") and hasattr(module, "pack"):
                self.expert_bytes = module.weight_bytes / module.num_experts
                self._hooks.append(module.register_forward_pre_hook(self._pre(EXPERTS)))
                self._hooks.append(module.register_forward_hook(self._post))


def _run(
    llm: LLM, timer: MoeStageTimer, prompts: list[list[int]], max_tokens: int
) -> tuple[float, float, int]:
    """CPU and wall seconds of the generate call, and the experts its steps ran."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    timer.reset()
    experts_before = llm.stats().moe_experts_used
    start, wall_start = time.process_time(), time.perf_counter()
    llm.generate(prompts, params)
    cpu, wall = time.process_time() - start, time.perf_counter() - wall_start
    return cpu, wall, llm.stats().moe_experts_used - experts_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an MoE model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--prefill-rows", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument(
        "--decode-prompt-tokens",
        type=int,
        default=16,
        help="each decode row's prompt length: the context its steps' attention reads",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--wall",
        action="store_true",
        help="also print each stage's wall time, and wall - CPU/threads",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rng = random.Random(0)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    timer = MoeStageTimer()
    llm.set_profiler(timer)
    vocab = 32000

    def prompts(rows: int, tokens: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(rows)]

    _run(llm, timer, prompts(2, 32), 2)  # warm-up: kernels built, buffers touched
    rows = []
    cpu, wall, _ = _run(llm, timer, prompts(args.prefill_rows, args.prefill_tokens), 1)
    rows.append(
        Regime(f"prefill {args.prefill_rows}x{args.prefill_tokens}", 1, cpu, wall, timer.split())
    )
    for batch in (int(b) for b in args.batches.split(",")):
        batch_prompts = prompts(batch, args.decode_prompt_tokens)
        # The prompts once to fill the prefix cache, so that the two runs below compute
        # the same (cached) prompts and their difference is the decode steps alone.
        _run(llm, timer, batch_prompts, 1)
        one_cpu, one_wall, prompts_experts = _run(llm, timer, batch_prompts, 1)
        first = timer.split()
        cpu, wall, experts = _run(llm, timer, batch_prompts, args.decode_steps + 1)
        split = {
            clock: {k: v - first[clock].get(k, 0.0) for k, v in stages.items()}
            for clock, stages in timer.split().items()
        }
        # The same prompts route the same: the difference is the decode steps' experts.
        per_step = (experts - prompts_experts) / args.decode_steps
        label = f"decode batch {batch}"
        rows.append(
            Regime(label, args.decode_steps, cpu - one_cpu, wall - one_wall, split, per_step, batch)
        )

    bandwidth = measure_bandwidth()
    # The peak `tokenmill bench` divides by (child.measure_peaks' CPU shapes), so this
    # prefill share and the bench's prefill roofline have one denominator.
    shape = ModelShape.from_dir(args.model)
    peak = measure_matmul_peak("bfloat16", llm_matmul_shapes(shape, 256))
    print(
        f"read bandwidth {bandwidth.read_gbs:.1f} GB/s, bf16 matmul peak {peak.gflops:.0f} "
        f"GFLOP/s at {peak.shape}"
    )
    # The bench's formula (report.prefill_flops): each prompt's FLOPs, its first token's
    # lm_head included, over the step's CPU seconds / threads (its wall on a quiet machine).
    # The peak is timed on the wall, so the share means something on a quiet machine only.
    prefill = rows[0]
    flops = total_flops(shape, [RequestWork(args.prefill_tokens, 0, 1)] * args.prefill_rows)
    per_thread_s = prefill.cpu / torch.get_num_threads()
    print(
        f"{prefill.label}: {flops / 1e9:.0f} GFLOP in {prefill.cpu:.3f} CPU-s, "
        f"{flops / per_thread_s / (peak.gflops * 1e9):.0%} of the peak at CPU-s / threads "
        "(quiet machines only)"
    )
    print(f"one expert's packed weights: {timer.expert_bytes / 1e6:.1f} MB")
    stages = sorted({k for row in rows for k in row.split["cpu"]})
    print("CPU seconds per step (all threads), by stage:")
    _table(rows, stages, lambda row, stage: row.split["cpu"].get(stage, 0.0), lambda r: r.cpu)
    # The KV cache a decode step's attention reads: each row's context at the middle step.
    context = args.decode_prompt_tokens + (args.decode_steps + 1) / 2
    kv_bytes_per_row = context * _kv_bytes_per_token(args.model, args.dtype)
    for row in rows:
        if row.expert_reads is not None:
            experts_s = row.expert_reads * timer.expert_bytes / (bandwidth.read_gbs * 1e9)
            kv_s = row.batch * kv_bytes_per_row / (bandwidth.read_gbs * 1e9)
            print(
                f"{row.label}: experts' bytes / bandwidth {experts_s:.4f} s/step "
                f"({row.expert_reads:.1f} expert reads); KV cache bytes / bandwidth "
                f"{kv_s:.4f} s/step ({context:.0f} tokens a row)"
            )
    if not args.wall:
        return
    threads = torch.get_num_threads()
    print("main thread's CPU seconds per step, by stage (its wall time when not preempted):")
    _table(rows, stages, lambda row, stage: row.split["main"].get(stage, 0.0))
    print(
        f"main thread's CPU - all threads' CPU / {threads} per step, by stage: the time the "
        "other threads wait on the main one (Python, torch ops on one thread, uneven splits)"
    )
    _table(
        rows,
        stages,
        lambda row, stage: (
            row.split["main"].get(stage, 0.0) - row.split["cpu"].get(stage, 0.0) / threads
        ),
    )
    print("wall seconds per step, by stage (meaningful on a quiet machine only):")
    _table(rows, stages, lambda row, stage: row.split["wall"].get(stage, 0.0), lambda r: r.wall)


@dataclass
class Regime:
    """One measured regime: its steps, the generate call's CPU and wall seconds, and its
    stages' exclusive seconds by clock ("cpu": all threads, "main": the main thread's
    CPU, "wall")."""

    label: str
    steps: int
    cpu: float
    wall: float
    split: dict[str, dict[str, float]]
    expert_reads: float | None = None  # per step, decode only
    batch: int = 0  # decode rows


def _kv_bytes_per_token(model_dir: str, dtype: str) -> float:
    """K and V of one token over every layer, from the model's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    itemsize = getattr(torch, dtype).itemsize
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * itemsize


def _table(rows, stages, cell, total=None) -> None:
    """One line per regime: its total per step (where given), then `cell(row, stage)` per
    step for each stage."""
    print(f"{'regime':24s} {'s/step':>8s} " + " ".join(f"{s[:14]:>14s}" for s in stages))
    for row in rows:
        whole = f"{total(row) / row.steps:8.4f}" if total else f"{'':8s}"
        cells = " ".join(f"{cell(row, s) / row.steps:14.4f}" for s in stages)
        print(f"{row.label:24s} {whole} {cells}")


if __name__ == "__main__":
    main()
