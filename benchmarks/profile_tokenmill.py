"""Where tokenmill's time goes on a benchmark workload.

    python benchmarks/profile_tokenmill.py --preset mixed64 --dtype float32
    python benchmarks/profile_tokenmill.py --preset mixed64 --torch-profiler   # op level

The default mode times the engine's stages by wrapping them from the outside (forward
hooks on every nn.Linear, wrappers around scheduling, input preparation, attention and
sampling): on CPU every op is synchronous, so wall-clock time inside a stage is that
stage's cost, and what is left is Python and engine bookkeeping. Hooks add about a
microsecond per call; the run is otherwise the benchmark's own tokenmill run.
`--torch-profiler` lists the aten ops with the most self time instead.
Nothing is edited in the engine; a stage it no longer has is reported as absent.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from functools import wraps

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import PRESETS, load_preset, warmup_prompts


class StageClock:
    """Accumulates wall time per stage; a stage entered inside another is subtracted
    from the outer one, so the shares add up to the total."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [stage, start, time spent in nested stages]

    def enter(self, stage: str) -> None:
        self._stack.append([stage, time.perf_counter(), 0.0])

    def exit(self) -> None:
        stage, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[stage] += elapsed - nested
        self.calls[stage] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, stage: str, fn):
        @wraps(fn)
        def timed(*args, **kwargs):
            self.enter(stage)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed

    def hook_module(self, module: torch.nn.Module, stage: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.enter(stage))
        module.register_forward_hook(lambda *_: self.exit())


def instrument(llm: LLM, clock: StageClock) -> list[str]:
    """Wrap the engine's stages in place; return the stages that could not be found."""
    missing = []
    engine = llm.engine
    runner = getattr(engine, "runner", None)
    model = getattr(runner, "model", None)

    def patch(owner, name: str, stage: str) -> None:
        if owner is None or not callable(getattr(owner, name, None)):
            missing.append(stage)
            return
        setattr(owner, name, clock.wrap(stage, getattr(owner, name)))

    patch(getattr(engine, "scheduler", None), "schedule", "scheduler")
    patch(runner, "_prepare", "input preparation")
    patch(runner, "sampler", "sampling")
    if model is None:
        missing.append("model")
        return missing
    clock.hook_module(model, "model: other ops (embedding, norms, rotary, activation, residual)")
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            stage = "lm_head (logits)" if module is lm_head else "model: linear layers"
            clock.hook_module(module, stage)
    if lm_head is None:
        missing.append("lm_head (logits)")
    # The attention function is imported by name into each model module: wrap it there.
    from tokenmill.engine import attention

    original = getattr(attention, "paged_attention", None)
    wrapped = clock.wrap("model: attention (cache write, gather, sdpa)", original)
    found = False
    for module in list(sys.modules.values()):
        is_user = module is not attention and module is not None
        if is_user and getattr(module, "paged_attention", None) is original:
            module.paged_attention = wrapped
            found = True
    if original is None or not found:
        missing.append("model: attention")
    return missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mixed64", choices=list(PRESETS))
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--torch-profiler", action="store_true", help="op-level aten table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype=args.dtype)
    workload = load_preset(args.preset, llm.model_dir)
    llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]

    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(workload.prompt_ids, params)
        wall = time.perf_counter() - start
        print(
            f"{args.preset} {args.dtype}: {wall:.2f} s under the profiler (slower than a real run)"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return

    clock = StageClock()
    missing = instrument(llm, clock)
    steps_before = llm.stats().num_steps
    start = time.perf_counter()
    llm.generate(workload.prompt_ids, params)
    wall = time.perf_counter() - start
    num_steps = llm.stats().num_steps - steps_before
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    print(f"{args.preset} {args.dtype}: {wall:.2f} s, {tokens / wall:,.0f} tok/s, {num_steps} steps "
          f"({wall / num_steps * 1e3:.1f} ms/step), threads {torch.get_num_threads()}")  # fmt: skip
    accounted = sum(clock.seconds.values())
    rows = sorted(clock.seconds.items(), key=lambda kv: -kv[1])
    rows.append(("rest: engine bookkeeping, Python, detokenization", wall - accounted))
    width = max(len(name) for name, _ in rows)
    for name, seconds in rows:
        calls = clock.calls.get(name)
        per_call = f"  {calls:>7} calls" if calls else ""
        print(f"  {name:<{width}}  {seconds:7.2f} s  {seconds / wall:6.1%}{per_call}")
    for stage in missing:
        print(f"  (not found in this engine: {stage})")


if __name__ == "__main__":
    main()
