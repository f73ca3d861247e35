"""The KV cache on 4 KiB pages against 2 MiB (transparent huge) pages, side by side.

    python benchmarks/kv_cache_pages.py                  # decode attention, 30 layers' caches
    python benchmarks/kv_cache_pages.py --engine int8    # mixed64, two engines in turn
    python benchmarks/kv_cache_pages.py --engine none    # the same in bf16
    python benchmarks/kv_cache_pages.py --engine int8 --scattered   # a long job's free list

A decode step reads every sequence's blocks, 2 KiB runs scattered over a cache of
gigabytes: with 4 KiB pages almost every run misses the TLB. Since the engine allocates
its cache with host_memory.huge_page_zeros, this measures what that is worth:
- the attention case is benchmarks/attention_kernel.py's decode case (64 sequences, half
  sharing a 256-token prefix) over --layers caches, each cache once on plain pages and
  once copied to huge pages, the two alternating call by call (best of 5 calls a round);
- --engine builds two engines in one process, one with TOKENMILL_HUGE_PAGES=0, and runs
  mixed64 on each in turn, the prefix cache emptied before every run; their greedy
  outputs must agree. A fresh engine hands out blocks in order, so a sequence's blocks
  share pages; --scattered shuffles the free blocks before every run (the same order in
  both engines), as a job that has freed and reused blocks for hours leaves them.
Ratios are 4 KiB time / 2 MiB time, per round; read their median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention_kernel  # noqa: E402

from tokenmill.engine.worker import host_memory  # noqa: E402


def _on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    shape = tuple(tensor.shape)
    return host_memory.lazy_zeros(shape, tensor.dtype, huge_pages=True).copy_(tensor)


def attention(layers: int, rounds: int) -> None:
    original = attention_kernel.Layout.__init__
    wanted = {"huge": False}

    def init(self, dtype, num_blocks=6000):
        original(self, dtype, num_blocks)
        if wanted["huge"]:
            self.k, self.v = _on_huge_pages(self.k), _on_huge_pages(self.v)

    original_int8 = attention_kernel.Layout.int8

    def int8(self):
        k8, v8 = original_int8(self)
        return (_on_huge_pages(k8), _on_huge_pages(v8)) if wanted["huge"] else (k8, v8)

    attention_kernel.Layout.__init__ = init
    attention_kernel.Layout.int8 = int8
    cases = {}
    for huge in (False, True):
        wanted["huge"] = huge
        native, _portable, native_int8, _flops = attention_kernel.decode_case(
            torch.bfloat16, None, layers
        )
        cases[huge] = {"bf16 cache": native, "int8 cache": native_int8}
    for name in ("bf16 cache", "int8 cache"):
        ratios = []
        for _ in range(rounds):
            plain, huge = attention_kernel.best_of([cases[False][name], cases[True][name]], 5)
            ratios.append(plain / huge)
        print(
            f"decode attention, {layers} layers, {name}: 4 KiB / 2 MiB per round "
            f"{' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.3f} "
            f"(last: {plain * 1e3:.1f} vs {huge * 1e3:.1f} ms)"
        )


def _scatter_free_blocks(llm, seed: int) -> None:
    """The free queue in a random order: blocks handed out far apart, as in a long job."""
    queue = llm.engine.block_manager.free_queue
    blocks = list(queue)
    random.Random(seed).shuffle(blocks)
    queue.clear()
    queue.update((block, None) for block in blocks)


def engine(quantization: str | None, rounds: int, scattered: bool) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.workload import load_preset, warmup_prompts
    from tokenmill.engine.worker.attention import portable as engine_attention

    # The attention calls of decode-only steps (64 query rows at most), timed apart: they
    # are what the pages change, a quarter of a run, and less noisy than the whole.
    current, decode_attention = ["4 KiB"], {"4 KiB": 0.0, "2 MiB": 0.0}
    native = engine_attention.native_paged_attention

    def timed_attention(q, *args, **kwargs):
        start = time.perf_counter()
        out = native(q, *args, **kwargs)
        if q.shape[0] <= 64:
            decode_attention[current[0]] += time.perf_counter() - start
        return out

    engine_attention.native_paged_attention = timed_attention
    engines = {}
    for name, huge_pages in (("4 KiB", False), ("2 MiB", True)):
        engines[name] = LLM(dtype="bfloat16", quantization=quantization, huge_pages=huge_pages)
    workload = load_preset("mixed64", engines["4 KiB"].model_dir)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    for llm in engines.values():
        llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))
    seconds = {name: [] for name in engines}
    attention_seconds = {name: [] for name in engines}
    outputs = {}
    for r in range(rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            llm = engines[name]
            llm.engine.block_manager.forget_cache()
            if scattered:
                _scatter_free_blocks(llm, seed=r)
            current[0], before = name, decode_attention[name]
            start = time.perf_counter()
            results = llm.generate(workload.prompt_ids, params)
            seconds[name].append(time.perf_counter() - start)
            attention_seconds[name].append(decode_attention[name] - before)
            outputs[name] = [result.outputs[0].token_ids for result in results]
        print(
            f"round {r + 1}: "
            + "  ".join(
                f"{n} {seconds[n][-1]:.2f} s (decode attention {attention_seconds[n][-1]:.2f} s)"
                for n in engines
            )
        )
    if outputs["4 KiB"] != outputs["2 MiB"]:
        raise SystemExit("the two engines' greedy outputs differ")
    ratios = [a / b for a, b in zip(seconds["4 KiB"], seconds["2 MiB"])]
    attention = [a / b for a, b in zip(attention_seconds["4 KiB"], attention_seconds["2 MiB"])]
    print(
        f"mixed64 {quantization or 'bf16'}{', scattered blocks' if scattered else ''}: medians {statistics.median(seconds['4 KiB']):.2f} s "
        f"(4 KiB) and {statistics.median(seconds['2 MiB']):.2f} s (2 MiB); per-round ratio "
        f"median {statistics.median(ratios):.3f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"decode attention {sum(attention_seconds['4 KiB']):.2f} vs "
        f"{sum(attention_seconds['2 MiB']):.2f} s over the rounds, per-round ratio median "
        f"{statistics.median(attention):.3f}, range {min(attention):.2f}-{max(attention):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine", choices=["int8", "none"], default=None)
    parser.add_argument("--scattered", action="store_true", help="shuffle the free blocks")
    args = parser.parse_args()
    if not host_memory.asks_for_huge_pages():
        raise SystemExit("this machine does not give transparent huge pages on request")
    if args.engine:
        engine(None if args.engine == "none" else args.engine, args.rounds, args.scattered)
    else:
        attention(args.layers, args.rounds)


if __name__ == "__main__":
    main()
