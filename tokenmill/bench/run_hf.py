"""Runs the workload through HF transformers `generate` - the baseline a notebook user has.

Its best configuration: prompts sorted by length (so a batch pads little), batched with
left padding, greedy, exactly the requested number of tokens (min_new_tokens ==
max_new_tokens, so EOS cannot end a row early), logits only for the last position
(transformers' default in generate).
"""

from __future__ import annotations

import time

from tokenmill.bench.result import RunResult, Stopwatch, tpot
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts


class _StepClock:
    """A stopping criterion that never stops, only notes when each token step finished."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(job: Job, workload: Workload) -> RunResult:
    """Load the model with transformers, warm up, time batched generate over the workload."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    device = torch.device(job.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=getattr(torch, job.system.dtype)
    ).to(device)
    model.eval()
    pad_id = _pad_id(model)
    # A sequential workload's requests run one at a time, as the same user would send them.
    batch_size = 1 if workload.sequential else int(job.system.options.get("batch_size", 32))

    def generate(prompts: list[list[int]], num_new: int, clock: _StepClock | None = None):
        width = max(len(p) for p in prompts)
        ids = [[pad_id] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor(ids, device=device),
                attention_mask=torch.tensor(mask, device=device),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=pad_id,
                stopping_criteria=transformers.StoppingCriteriaList([clock] if clock else []),
            )
        return out[:, width:].tolist(), width

    generate(warmup_prompts(workload), 4)

    n = workload.num_requests
    order = sorted(range(n), key=lambda i: len(workload.prompt_ids[i]))
    outputs: list[list[int]] = [[] for _ in range(n)]
    computed, generated = [0] * n, [0] * n
    ttft, tpots = [0.0] * n, [0.0] * n
    with Stopwatch() as clock:
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            # One generate call makes every row as long as the batch's longest request;
            # rows that asked for fewer tokens keep only theirs.
            num_new = max(workload.output_lens[i] for i in rows)
            steps = _StepClock()
            submitted = time.perf_counter() if workload.sequential else clock.start
            new_ids, width = generate([workload.prompt_ids[i] for i in rows], num_new, steps)
            for row, i in enumerate(rows):
                wanted = workload.output_lens[i]
                outputs[i] = new_ids[row][:wanted]
                computed[i], generated[i] = width, num_new  # padding is computed too
                ttft[i] = steps.times[0] - submitted
                tpots[i] = tpot(steps.times[0], steps.times[wanted - 1], wanted)
    return RunResult(
        system=job.system.label,
        wall_s=clock.wall_s,
        num_prompt_tokens=workload.num_prompt_tokens,
        num_computed_prompt_tokens=sum(computed),
        num_cached_prompt_tokens=0,
        num_generated_tokens=workload.num_output_tokens,
        computed_prompt=computed,
        cached_prompt=[0] * n,
        generated=generated,
        ttft_s=ttft,
        tpot_s=tpots,
        cpu_s=clock.cpu_s,
        extra={
            "batch_size": batch_size,
            "attn_implementation": model.config._attn_implementation,
            # How transformers ran a mixture of experts' experts (its default: grouped_mm).
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
        },
        output_ids=outputs,
    )


def _pad_id(model) -> int:
    # Any id works under the attention mask; prefer the model's own pad, then EOS.
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, model.config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0
