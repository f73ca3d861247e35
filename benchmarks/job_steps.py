"""A bench preset's engine steps one by one: prompt tokens computed, tokens sampled, the
experts a mixture of experts' layers ran and the tokens each got on average, and the
step's CPU seconds (all threads; a busy machine's other work does not count). Read
through `LLM.generate(on_step=...)` and the engine's counters only.

    OMP_WAIT_POLICY=passive python benchmarks/job_steps.py --model DIR --preset mixed64

Set OMP_WAIT_POLICY=passive with more than one thread, so a thread waiting at a barrier
sleeps instead of spinning CPU time into the figures. Prefix-cache hits are the rows'
cached tokens (printed at the end); decode rows beside a prompt chunk are the sampled
tokens of a step that also computed prompt tokens, less the prompts it finished. Only
steps that computed prompt tokens get a line; the decode-only ones are summed.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.flops import ModelShape
from tokenmill.bench.workload import load_preset, warmup_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--preset", default="mixed64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        help="NAME=INT, e.g. max_num_batched_tokens=4096",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {k: int(v) for k, v in (o.split("=", 1) for o in args.engine_option)}
    llm = LLM(args.model, dtype=args.dtype, **options)
    shape = ModelShape.from_dir(args.model)
    workload = load_preset(args.preset, args.model)
    llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    rows = []
    stats = llm.stats()
    last = (time.process_time(), stats.computed_prompt_tokens, stats.generated_tokens,
            stats.moe_experts_used)  # fmt: skip

    def on_step(stats) -> None:
        nonlocal last
        now = (time.process_time(), stats.computed_prompt_tokens, stats.generated_tokens,
               stats.moe_experts_used)  # fmt: skip
        rows.append(tuple(b - a for a, b in zip(last, now)))
        last = now

    outputs = llm.generate(workload.prompt_ids, params, on_step=on_step)
    layers = shape.num_sparse_layers
    print("step  prompt_tok  sampled  experts/layer  tokens/expert  CPU-s")
    prefill_cpu = 0.0
    for i, (cpu, prompt, sampled, experts) in enumerate(rows):
        per_layer = experts / layers if layers else 0.0
        # Each token the step feeds goes to top-k experts: its prompt tokens and decode
        # rows, which `sampled` over-counts by the prompts it finishes (a few of thousands).
        tokens = prompt + sampled
        per_expert = tokens * shape.experts_per_token / per_layer if per_layer else 0.0
        if prompt:
            prefill_cpu += cpu
            print(
                f"{i:4d} {prompt:11d} {sampled:8d} {per_layer:14.1f} {per_expert:14.1f} {cpu:6.2f}"
            )
    decode = [r for r in rows if not r[1]]
    print(
        f"{len(rows)} steps: {len(rows) - len(decode)} computed prompt tokens, in "
        f"{prefill_cpu:.2f} CPU-s; {len(decode)} decode-only steps in "
        f"{sum(r[0] for r in decode):.2f} CPU-s; prefix-cache hits "
        f"{sum(o.cached_tokens for o in outputs)} of {sum(o.prompt_tokens for o in outputs)} "
        "prompt tokens"
    )


if __name__ == "__main__":
    main()
