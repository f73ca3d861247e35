"""Where tokenmill's time goes on a benchmark workload.

    python benchmarks/profile_tokenmill.py --preset mixed64 --dtype float32
    python benchmarks/profile_tokenmill.py --preset mixed64 --torch-profiler   # op level
    python benchmarks/profile_tokenmill.py --dtype bfloat16 --quantization int8
    python benchmarks/profile_tokenmill.py --dtype bfloat16 --kv-cache-dtype int8

The default mode times the engine's stages by wrapping them from the outside (forward
hooks on every linear layer, wrappers around scheduling, input preparation, attention and
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
from tokenmill.engine.worker.kv_cache import KV_CACHE_DTYPES


class StageClock:
    """Accumulates wall time per stage; a stage entered inside another is subtracted
    from the outer one, so the shares add up to the total."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        # The same time split by the kind of step it happened in ("" = outside any step).
        self.phase = ""
        self.by_phase: dict[tuple[str, str], float] = defaultdict(float)
        self._stack: list[list] = []  # [stage, start, time spent in nested stages]

    def enter(self, stage: str) -> None:
        self._stack.append([stage, time.perf_counter(), 0.0])

    def exit(self) -> None:
        stage, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[stage] += elapsed - nested
        self.by_phase[self.phase, stage] += elapsed - nested
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


PROMPT_STEPS = "steps with prompt tokens"
DECODE_STEPS = "decode-only steps"


class StepLog:
    """Wall time of each runner step, split into steps that carry prompt tokens and
    decode-only steps (the two behave very differently: big matmuls vs small ones)."""

    def __init__(self, clock: StageClock) -> None:
        self.clock = clock
        self.steps: list[tuple[bool, int, float]] = []  # (has prefill, tokens, seconds)

    def wrap(self, run):
        @wraps(run)
        def timed(out, *args, **kwargs):
            has_prefill = bool(getattr(out, "prefills", None))
            self.clock.phase = PROMPT_STEPS if has_prefill else DECODE_STEPS
            start = time.perf_counter()
            try:
                return run(out, *args, **kwargs)
            finally:
                tokens = getattr(out, "num_tokens", 0)
                self.steps.append((has_prefill, tokens, time.perf_counter() - start))
                self.clock.phase = ""

        return timed

    def lines(self) -> list[str]:
        lines = []
        for has_prefill, name in ((True, PROMPT_STEPS), (False, DECODE_STEPS)):
            kind = [(n, t) for p, n, t in self.steps if p == has_prefill]
            if kind:
                seconds = sum(t for _, t in kind)
                tokens = sum(n for n, _ in kind)
                lines.append(
                    f"  {name}: {len(kind)} steps, {seconds:.2f} s, {tokens:,} tokens "
                    f"({seconds / len(kind) * 1e3:.0f} ms/step, {tokens / seconds:,.0f} tok/s)"
                )
        return lines


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
    patch(runner, "prepare", "input preparation")
    patch(runner, "sampler", "sampling")
    if model is None:
        missing.append("model")
        return missing
    clock.hook_module(model, "model: other ops (embedding, norms, rotary, activation, residual)")
    lm_head = getattr(model, "lm_head", None)
    from tokenmill.engine.quant import linear_kinds

    kinds = linear_kinds()
    for module in model.modules():
        if isinstance(module, kinds):
            stage = "lm_head (logits)" if module is lm_head else "model: linear layers"
            clock.hook_module(module, stage)
    if lm_head is None:
        missing.append("lm_head (logits)")
    # The attention function is imported by name into each model module: wrap it there.
    from tokenmill.engine.worker.attention import portable as attention

    original = getattr(attention, "paged_attention", None)
    wrapped = clock.wrap("model: attention (cache write and attention)", original)
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
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--torch-profiler", action="store_true", help="op-level aten table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
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
    step_log = StepLog(clock)
    runner = llm.engine.runner
    runner.run = step_log.wrap(runner.run)
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
    print(
        f"  {'stage':<{width}}  {'total':>9}  {'share':>6}  {'prompt steps':>12}  {'decode steps':>12}"
    )
    for name, seconds in rows:
        split = [clock.by_phase.get((phase, name)) for phase in (PROMPT_STEPS, DECODE_STEPS)]
        cells = "".join(f"  {t:10.2f} s" if t is not None else f"  {'':>12}" for t in split)
        print(f"  {name:<{width}}  {seconds:7.2f} s  {seconds / wall:6.1%}{cells}")
    for line in step_log.lines():
        print(line)
    for stage in missing:
        print(f"  (not found in this engine: {stage})")


if __name__ == "__main__":
    main()
