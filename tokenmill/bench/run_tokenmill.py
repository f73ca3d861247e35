"""Runs the workload through tokenmill's own engine (inside a benchmark child process)."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.bench.bandwidth import DecodeStepTimer
from tokenmill.bench.result import RunResult, Stopwatch, tpot
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts


def run_tokenmill(job: Job, workload: Workload) -> RunResult:
    """Load the model, warm up, then time one `LLM.generate` over the whole workload (or
    one per request, in turn, for a sequential workload).

    A structured system enforces the workload's JSON schema: greedy, max_tokens the
    workload's output length, each request ending where its grammar does. Otherwise every
    request generates exactly its output length (the job's, when it carries its own).
    """
    from tokenmill import LLM, SamplingParams, StructuredOutputs
    from tokenmill.bench.lora import load_adapters_before_the_clock

    if job.system.options.get("lora") == "merged":
        return run_merged(job, workload)
    llm = LLM(
        job.model_dir,
        dtype=job.system.dtype,
        device=job.device,
        **job.system.options.get("engine_args", {}),
    )
    constraint = None
    if job.system.options.get("structured"):
        constraint = StructuredOutputs(json=workload.json_schema)
    # Warm-up compiles the constraint too: a real job pays that once, not per request.
    warmup = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=constraint)
    llm.generate(warmup_prompts(workload), warmup)
    if constraint is not None:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=constraint)
            for n in workload.output_lens
        ]
    else:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in job.output_lens or workload.output_lens
        ]
    lora, extra = None, {}
    if job.system.options.get("lora") == "mixed":
        lora = _lora_requests(job, workload)
        # The clock times serving the rows; the one-time load is reported beside it.
        extra["adapter_load_s"] = load_adapters_before_the_clock(
            llm, lora, warmup_prompts(workload)[0], warmup
        )
        slot_loads = llm.stats().num_adapter_loads
    before = replace(llm.stats())
    steps = DecodeStepTimer()  # decode step times by batch size (bandwidth.py)
    with Stopwatch() as clock:
        if workload.sequential:  # one request at a time: nothing to batch
            outputs = []
            for i, (prompt, param) in enumerate(zip(workload.prompt_ids, params)):
                one = None if lora is None else [lora[i]]
                steps.start(llm.stats())
                outputs += llm.generate([prompt], [param], lora_request=one, on_step=steps)
        else:
            steps.start(llm.stats())
            outputs = llm.generate(workload.prompt_ids, params, lora_request=lora, on_step=steps)
    after = llm.stats()
    extra["decode_steps"] = steps.summary()
    extra["prefill_steps"] = steps.prefill_summary()
    if lora is not None:  # more adapters than slots: some reloaded within the timed run
        extra["timed_slot_loads"] = llm.stats().num_adapter_loads - slot_loads
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    if constraint is not None:
        num_masked = after.num_constrained_tokens - before.num_constrained_tokens
        extra |= {
            "num_constrained_tokens": num_masked,
            "mask_fill_us_per_token": _per_token(
                after.grammar_fill_s - before.grammar_fill_s, num_masked
            ),
            "mask_blocking_us_per_token": _per_token(
                after.grammar_blocking_s - before.grammar_blocking_s, num_masked
            ),
            "num_complete": sum(bool(o.structured_output_complete) for o in outputs),
        }

    return _result(job, llm, outputs, clock, before, after, extra, sequential=workload.sequential)


def _result(
    job: Job, llm, outputs, clock, before, after, extra: dict, *, sequential: bool = False
) -> RunResult:
    ttft, tpots = [], []
    for out in outputs:
        m = out.metrics
        # From the request's own submission when they go one at a time, else from the
        # moment the whole workload was handed over.
        start = m.arrival_time if sequential else clock.start
        ttft.append(m.first_token_time - start)
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
            **extra,
            **_gpu_memory(llm.device),
        },
        output_ids=[o.token_ids for o in outputs],
    )


def _lora_requests(job: Job, workload: Workload) -> list:
    from tokenmill import LoRARequest

    paths = job.system.options["adapters"]
    return [LoRARequest(f"adapter-{i:02d}", paths[i]) for i in workload.adapters]


def run_merged(job: Job, workload: Workload) -> RunResult:
    """The merge-per-adapter baseline: for each adapter in turn, merge it into the base
    weights, load the merged model, run that adapter's requests; all of it timed."""
    import tempfile

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine import EngineStats, merge_adapter

    paths = job.system.options["adapters"]
    lens = job.output_lens or workload.output_lens
    outputs: list = [None] * workload.num_requests
    before, after = EngineStats(), EngineStats()
    llm = None
    with tempfile.TemporaryDirectory(prefix="tokenmill-merged-") as tmp, Stopwatch() as clock:
        for index, path in enumerate(paths):
            rows = [i for i, a in enumerate(workload.adapters) if a == index]
            if not rows:
                continue
            llm = None  # the previous merged model's memory goes first
            merged = merge_adapter(job.model_dir, path, f"{tmp}/{index}")
            llm = LLM(
                str(merged),
                dtype=job.system.dtype,
                device=job.device,
                **job.system.options.get("engine_args", {}),
            )
            params = [
                SamplingParams(temperature=0.0, max_tokens=lens[i], ignore_eos=True) for i in rows
            ]
            for i, output in zip(
                rows, llm.generate([workload.prompt_ids[i] for i in rows], params)
            ):
                outputs[i] = output
            stats = llm.stats()
            for name in (
                "computed_prompt_tokens",
                "cached_prompt_tokens",
                "num_steps",
                "num_preemptions",
            ):
                setattr(after, name, getattr(after, name) + getattr(stats, name))
    return _result(job, llm, outputs, clock, before, after, {"num_merges": len(paths)})


def _per_token(seconds: float, num_tokens: int) -> float:
    return seconds / num_tokens * 1e6 if num_tokens else 0.0


def _gpu_memory(device) -> dict:
    """Peak GPU memory of the process (weights, KV cache, activations, graphs), in MiB."""
    if device.type != "cuda":
        return {}
    import torch

    return {
        "gpu_peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
        "gpu_peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
    }
