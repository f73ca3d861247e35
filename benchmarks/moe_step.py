"""Where a mixture-of-experts model's step time goes: prefill and decode at a few batch
sizes, split into the router, the experts' one grouped call (sort, gather, gate_up, the
activation, down and the weighted sum back into token order), attention, the dense
linear layers and the lm_head, beside each regime's bound. Times are CPU seconds of the process (all its threads), so a
busy machine's other work does not count; on a quiet one divide by the threads for wall
time.

    python benchmarks/moe_step.py --model DIR --dtype bfloat16 --quantization int8
    TOKENMILL_CACHE_DIR=... python benchmarks/moe_step.py --shape olmoe-1b-7b --layers 4

Prefill is `--prefill-rows` prompts of `--prefill-tokens` random token ids and one output
token; decode is `--batches` rows of 16-token prompts, timed as the difference between
`--decode-steps` + 1 output tokens and one (so the prompts' step cancels). The bound of a
decode step is the bytes of the experts its layers ran (the engine's count,
EngineStats.moe_experts_used) and the dense weights over the read bandwidth; of prefill, the active FLOPs over the
matmul peak - both measured in the same run (tokenmill.bench).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.bandwidth import measure_bandwidth
from tokenmill.bench.flops import measure_matmul_peak
from tokenmill.bench.profile import StageTimer

ROUTER, EXPERTS = "router", "experts (one call)"


class MoeStageTimer(StageTimer):
    """StageTimer plus the MoE blocks' router and experts as stages, and one expert's
    bytes (to turn the engine's count of experts run into the bytes a step must read)."""

    def __init__(self) -> None:
        super().__init__(linear_layers=True)
        self.expert_bytes = 0.0  # one expert's packed weights

    # CPU seconds of the whole process (every torch thread), not wall time: on a shared
    # machine a stage's wall time counts whatever else ran meanwhile.
    def enter(self, stage: str) -> None:
        self._stack.append([stage, time.process_time(), 0.0])

    def exit(self) -> None:
        stage, start, nested = self._stack.pop()
        elapsed = time.process_time() - start
        self.seconds[stage] += elapsed - nested
        self.calls[stage] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

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
) -> tuple[float, int]:
    """CPU seconds of the generate call, and the experts its steps ran."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    timer.reset()
    experts_before = llm.stats().moe_experts_used
    start = time.process_time()
    llm.generate(prompts, params)
    return time.process_time() - start, llm.stats().moe_experts_used - experts_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an MoE model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--prefill-rows", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
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
    wall, _ = _run(llm, timer, prompts(args.prefill_rows, args.prefill_tokens), 1)
    rows.append(
        (f"prefill {args.prefill_rows}x{args.prefill_tokens}", wall, dict(timer.seconds), 1)
    )
    for batch in (int(b) for b in args.batches.split(",")):
        batch_prompts = prompts(batch, 16)
        one, prompts_experts = _run(llm, timer, batch_prompts, 1)
        first = dict(timer.seconds)
        wall, experts = _run(llm, timer, batch_prompts, args.decode_steps + 1)
        seconds = {k: v - first.get(k, 0.0) for k, v in timer.seconds.items()}
        # The same prompts route the same: the difference is the decode steps' experts.
        per_step = (experts - prompts_experts) / args.decode_steps
        rows.append((f"decode batch {batch}", wall - one, seconds, args.decode_steps, per_step))

    bandwidth = measure_bandwidth()
    peak = measure_matmul_peak("bfloat16", [(512, 2048, 1024)])
    print(
        f"read bandwidth {bandwidth.read_gbs:.1f} GB/s, bf16 matmul peak {peak.gflops:.0f} GFLOP/s"
    )
    print(f"one expert's packed weights: {timer.expert_bytes / 1e6:.1f} MB")
    stages = sorted({k for row in rows for k in row[2]})
    print("CPU seconds per step (all threads), by stage:")
    print(f"{'regime':24s} {'s/step':>8s} " + " ".join(f"{s[:14]:>14s}" for s in stages))
    for row in rows:
        label, wall, seconds, steps = row[:4]
        cells = " ".join(f"{seconds.get(s, 0.0) / steps:14.4f}" for s in stages)
        line = f"{label:24s} {wall / steps:8.4f} {cells}"
        if len(row) > 4:
            experts_s = row[4] * timer.expert_bytes / (bandwidth.read_gbs * 1e9)
            line += (
                f"   experts' bytes / bandwidth {experts_s:.4f} s/step ({row[4]:.1f} expert reads)"
            )
        print(line)


if __name__ == "__main__":
    main()
