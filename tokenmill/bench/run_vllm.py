"""Runs the workload through vLLM's offline `LLM.generate` (GPU machines only).

This module imports nothing heavy from tokenmill: vLLM pins its own torch, so it usually
runs from a separate environment that sees only `tokenmill.bench` (via PYTHONPATH).
"""

from __future__ import annotations

from tokenmill.bench.result import RunResult, Stopwatch
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts


def run_vllm(job: Job, workload: Workload) -> RunResult:
    """Build a vLLM engine on the same model directory, warm up, time one generate."""
    from vllm import LLM, SamplingParams

    longest = max(len(p) + n for p, n in zip(workload.prompt_ids, workload.output_lens))
    engine_args = {
        "dtype": job.system.dtype,
        "enable_prefix_caching": True,
        "max_model_len": max(1024, longest + 16),
        "seed": 0,
        # Prompts arrive as ids; nothing needs vLLM's tokenizer (whose class guessing
        # from a converted directory is one more thing to go wrong).
        "skip_tokenizer_init": True,
        # Per-request timings are only recorded with stats on.
        "disable_log_stats": False,
        **job.system.options.get("engine_args", {}),
    }
    llm = LLM(model=job.model_dir, **engine_args)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate(
        [{"prompt_token_ids": p} for p in warmup_prompts(workload)], params(4), use_tqdm=False
    )
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_ids]
    with Stopwatch() as clock:
        outputs = llm.generate(prompts, [params(n) for n in workload.output_lens], use_tqdm=False)

    generated = [len(o.outputs[0].token_ids) for o in outputs]
    cached = [int(getattr(o, "num_cached_tokens", None) or 0) for o in outputs]
    ttft, tpots = _latencies(outputs, generated)
    return RunResult(
        system=job.system.label,
        wall_s=clock.wall_s,
        num_prompt_tokens=workload.num_prompt_tokens,
        num_computed_prompt_tokens=workload.num_prompt_tokens - sum(cached),
        num_cached_prompt_tokens=sum(cached),
        num_generated_tokens=sum(generated),
        computed_prompt=[len(p) - c for p, c in zip(workload.prompt_ids, cached)],
        cached_prompt=cached,
        generated=generated,
        ttft_s=ttft,
        tpot_s=tpots,
        cpu_s=clock.cpu_s,
        extra={"vllm_version": _version(), "engine_args": engine_args},
        output_ids=[list(o.outputs[0].token_ids) for o in outputs],
    )


def _latencies(outputs, generated: list[int]) -> tuple[list[float], list[float]]:
    """Per-request TTFT and TPOT from whatever metrics this vLLM version records.

    Returns empty lists when it records none; the report then shows no latency for vLLM.
    TTFT here is measured from each request's arrival, which in one offline call is the
    start of the call to within milliseconds.
    """
    ttft, tpots = [], []
    try:
        for out, n in zip(outputs, generated):
            m = out.metrics
            if getattr(m, "first_token_latency", None):  # v1 RequestStateStats
                first, last = m.first_token_ts, m.last_token_ts
                ttft.append(float(m.first_token_latency))
            else:  # v0 RequestMetrics
                first, last = m.first_token_time, m.last_token_time
                ttft.append(float(first - m.arrival_time))
            tpots.append(float(last - first) / (n - 1) if n > 1 else 0.0)
    except (AttributeError, TypeError):
        return [], []
    return ttft, tpots


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")
