"""The cut rules (fill, prefix, balance) on documents each asked many questions, run on
N engine workers that take shards in order as each frees up (as Dask's `engine`
resource hands them out).

    python benchmarks/prefix_affinity.py [--documents 40] [--questions 50] [--workers 2]
                                         [--max-tokens 16] [--shard-tokens 131072]
                                         [--rounds 1] [--smoke]

The rows (a document's text, then one question about it) are shuffled, tokenized with
the default model's tokenizer and planned by the pipeline's own `plan_shards`, once
per cut rule (`pipelines/prefix_cut.py`), with `min_shards` = the workers. Each worker
process loads one engine on its share of the cores, then all start together; the
rules alternate (fill, prefix, balance, fill, ...) on the same warm workers, each
worker's prefix cache emptied between runs. Printed per run: shards, the prompt tokens
shards may compute again (documents cut apart), the cached tokens the workers reported
against the forecast of each shard on a cold cache (`LLM.plan`: a shard's figure can
only grow on a worker that ran another shard first), the shards where the forecast
held, and the compute span (first shard start to last shard end). `--smoke` runs a
tiny workload to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time
from array import array

from tokenmill.engine import DEFAULT_MODEL, LLM, PlannedRequest, SamplingParams, describe_model
from tokenmill.pipelines.plan import plan_shards
from tokenmill.pipelines.prefix_cut import CUT_RULES, shared_prefix
from tokenmill.pipelines.tokenize import PromptRow

WORDS = [
    "river",
    "market",
    "harvest",
    "engine",
    "ledger",
    "winter",
    "copper",
    "lantern",
    "signal",
    "orchard",
    "bridge",
    "archive",
    "quarry",
    "harbor",
    "meadow",
    "furnace",
    "compass",
    "tunnel",
    "beacon",
    "granary",
    "vessel",
    "mill",
]


def documents_and_questions(num_documents: int, num_questions: int, seed: int = 0) -> list[str]:
    """Prompts: document d's text (a few hundred tokens), then question q about it;
    shuffled, so the planner, not the input's order, brings a document's rows together."""
    rng = random.Random(seed)
    prompts = []
    for d in range(num_documents):
        text = " ".join(rng.choice(WORDS) for _ in range(300))
        document = f"Document {d}.\n{text}\n\n"
        for q in range(num_questions):
            word = rng.choice(WORDS)
            prompts.append(f"{document}Question {q}: what does the document say of the {word}?")
    rng.shuffle(prompts)
    return prompts


def plan(prompts: list[str], params: SamplingParams, *, workers: int, shard_tokens: int, rule: str):
    tokenizer = describe_model(DEFAULT_MODEL).load_tokenizer()
    ids = tokenizer.encode_batch(prompts)
    rows = [PromptRow(i, f"r{i}", token_ids=array("i", t)) for i, t in enumerate(ids)]
    return plan_shards(
        rows, [params], model_key="bench", shard_tokens=shard_tokens, min_shards=workers, rule=rule
    )


def split_tokens(shards) -> int:
    """Prompt tokens the shards' workers may compute again: each shard's distinct prefix
    tokens, less the job's (for contiguous shards, what the rows on two sides of each
    cut share; the balance cut's shards are not contiguous)."""
    return sum(distinct_tokens(s.rows) for s in shards) - distinct_tokens(
        [r for s in shards for r in s.rows]
    )


def distinct_tokens(rows) -> int:
    """Prompt tokens of the rows with each shared prefix counted once."""
    ordered = sorted(rows, key=lambda r: list(r.token_ids))
    shared = sum(shared_prefix(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(len(r.token_ids) for r in ordered) - shared


def worker(threads: int, tasks, results, ready) -> None:
    import torch

    torch.set_num_threads(threads)
    llm = LLM(DEFAULT_MODEL)
    ready.wait()
    while (task := tasks.get()) is not None:
        if task == "reset":
            llm.reset_prefix_cache()
            ready.wait()
            continue
        index, prompts, params = task
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        results.put(
            (
                index,
                os.getpid(),
                sum(o.cached_tokens for o in outputs),
                started,
                time.perf_counter(),
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=131_072)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny workload: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.documents, args.questions, args.max_tokens, args.shard_tokens = 4, 6, 2, 4_000
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = documents_and_questions(args.documents, args.questions)
    plans = {
        rule: plan(prompts, params, workers=args.workers, shard_tokens=args.shard_tokens, rule=rule)
        for rule in CUT_RULES
    }
    context = mp.get_context("spawn")
    tasks, results = context.Queue(), context.Queue()
    ready = context.Barrier(args.workers + 1)
    threads = max(1, len(os.sched_getaffinity(0)) // args.workers)
    procs = [
        context.Process(target=worker, args=(threads, tasks, results, ready))
        for _ in range(args.workers)
    ]
    for p in procs:
        p.start()
    ready.wait()  # every engine loaded
    print(f"{args.documents} documents x {args.questions} questions, {args.workers} workers")
    try:
        for round_ in range(args.rounds):
            for rule in CUT_RULES:
                run(rule, plans[rule], params, tasks, results, ready, args.workers, round_)
    finally:
        for _ in procs:
            tasks.put(None)
        for p in procs:
            p.join()


def run(rule, shards, params, tasks, results, ready, workers, round_) -> None:
    forecast = [
        sum(LLM.plan([requests(s, params)], model=DEFAULT_MODEL).cached_tokens) for s in shards
    ]
    for s in shards:
        tasks.put((s.shard.index, [list(r.token_ids) for r in s.rows], params))
    done = [results.get() for _ in shards]
    cached = {index: c for index, _, c, _, _ in done}
    held = sum(1 for s, f in zip(shards, forecast) if cached[s.shard.index] >= f)
    span = max(d[4] for d in done) - min(d[3] for d in done)
    prompt = sum(s.shard.num_prompt_tokens for s in shards)
    print(
        f"round {round_} {rule:6}: {len(shards)} shards, {split_tokens(shards):,} prompt "
        f"tokens across cuts; cached {sum(cached.values()):,} of {prompt:,} (forecast on "
        f"cold shards {sum(forecast):,}; held on {held} of {len(shards)} shards); "
        f"compute span {span:.2f} s on {len({d[1] for d in done})} workers"
    )
    for _ in range(workers):
        tasks.put("reset")
    ready.wait()


def requests(shard, params) -> list[PlannedRequest]:
    return [PlannedRequest(r.token_ids, params) for r in shard.rows]


if __name__ == "__main__":
    main()
