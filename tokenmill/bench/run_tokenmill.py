"""Runs the workload through tokenmill's own engine (inside a benchmark child process)."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.bench.result import RunResult, Stopwatch, tpot
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts


def run_tokenmill(job: Job, workload: Workload) -> RunResult:
    """Load the model, warm up, then time one `LLM.generate` over the whole workload."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        job.model_dir,
        dtype=job.system.dtype,
        device=job.device,
        **job.system.options.get("engine_args", {}),
    )
    llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))
    before = replace(llm.stats())
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    with Stopwatch() as clock:
        outputs = llm.generate(workload.prompt_ids, params)
    after = llm.stats()
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")

    t0 = clock.start
    ttft, tpots = [], []
    for out in outputs:
        m = out.metrics
        ttft.append(m.first_token_time - t0)
        tpots.append(tpot(m.first_token_time, m.finish_time, out.completion_tokens))
    return RunResult(
        system=job.system.label,
        wall_s=clock.wall_s,
        num_prompt_tokens=sum(o.prompt_tokens for o in outputs),
        # The engine's own counters also see recomputation after a preemption.
        num_computed_prompt_tokens=after.computed_prompt_tokens - before.computed_prompt_tokens,
        num_cached_prompt_tokens=after.cached_prompt_tokens - before.cached_prompt_tokens,
        num_generated_tokens=sum(o.completion_tokens for o in outputs),
        computed_prompt=[o.prompt_tokens - o.cached_tokens for o in outputs],
        cached_prompt=[o.cached_tokens for o in outputs],
        generated=[o.completion_tokens for o in outputs],
        ttft_s=ttft,
        tpot_s=tpots,
        cpu_s=clock.cpu_s,
        extra={
            "num_steps": after.num_steps - before.num_steps,
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "dtype": str(llm.dtype).removeprefix("torch."),
            "device": str(llm.device),
            **_gpu_memory(llm.device),
        },
        output_ids=[o.token_ids for o in outputs],
    )


def _gpu_memory(device) -> dict:
    """Peak GPU memory of the process (weights, KV cache, activations, graphs), in MiB."""
    if device.type != "cuda":
        return {}
    import torch

    return {
        "gpu_peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
        "gpu_peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
    }
