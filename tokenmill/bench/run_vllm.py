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
    from vllm import SamplingParams

    def params(n: int) -> SamplingParams:
        # Token ids are all we compare; no text needed (and no tokenizer, if skipped).
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm, engine_args = _build_and_warm_up(job, workload, params(4))
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_ids]
    per_request = [params(n) for n in workload.output_lens]
    with Stopwatch() as clock:
        if workload.sequential:  # one request at a time
            outputs = []
            for prompt, param in zip(prompts, per_request):
                outputs += llm.generate([prompt], [param], use_tqdm=False)
        else:
            outputs = llm.generate(prompts, per_request, use_tqdm=False)

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


def _build_and_warm_up(job: Job, workload: Workload, warmup_params):
    """A vLLM engine that has served the warm-up prompts, and the arguments it took.

    Prompts arrive as ids, so vLLM's tokenizer is not needed; it is loaded by default
    (vLLM's most travelled path) and skipped on a second attempt if building or using
    the engine with it fails - some vLLM releases broke one mode or the other.
    """
    import gc

    from vllm import LLM

    longest = max(len(p) + n for p, n in zip(workload.prompt_ids, workload.output_lens))
    base = {
        "dtype": job.system.dtype,
        "enable_prefix_caching": True,
        "max_model_len": max(1024, longest + 16),
        "seed": 0,
        # Leaves room for a second attempt if the first engine's memory is not yet
        # released; far more KV cache than a small model needs either way.
        "gpu_memory_utilization": 0.45,
        # Per-request timings are only recorded with stats on.
        "disable_log_stats": False,
        **job.system.options.get("engine_args", {}),
    }
    attempts = [base]
    if "skip_tokenizer_init" not in job.system.options.get("engine_args", {}):
        attempts.append({**base, "skip_tokenizer_init": True})
    warmup = [{"prompt_token_ids": p} for p in warmup_prompts(workload)]
    errors = []
    for engine_args in attempts:
        llm = None
        try:
            llm = LLM(model=job.model_dir, **engine_args)
            llm.generate(warmup, warmup_params, use_tqdm=False)
            return llm, engine_args
        except Exception as error:  # any failure: try the next mode, report all if none works
            errors.append(f"{type(error).__name__}: {error}")
            del llm
            gc.collect()
    raise RuntimeError("vLLM failed in every mode: " + " | ".join(errors))


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
