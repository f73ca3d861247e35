"""One long prompt's prefill at a real model's widths: attention against the linears,
each against the bf16 matmul peak measured in the same run.

    python benchmarks/long_prefill.py --shape qwen2.5-1.5b --tokens 2048 4096 8192

Per layer of the shape (bf16, torch's threads), for each prompt length N:
- attention: the native kernel over a paged cache (16-token blocks, scattered) for the
  whole prompt as one chunk, and as the engine chunks it (chunks of --chunk tokens, each
  reading the earlier chunks from the cache); GFLOP/s count the causal work only
  (4 * heads * head_dim * sum of positions seen), as tokenmill/bench/flops.py does;
- linears: the layer's seven matmuls (q, k, v, o, gate, up, down) at N tokens through
  oneDNN with the weights packed once, as the engine runs them.
Calls alternate and the best of --repeat is kept (the machine may be busy): the shares and
the fractions of the peak are what to read, not the absolute times. Norms, rotary and the
activation ("the rest") are not timed here.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenmill.bench.flops import ModelShape, llm_matmul_shapes, measure_matmul_peak
from tokenmill.bench.scale_shapes import shape_config
from tokenmill.bench.timing import best_of

# Below the front door: a kernel micro-benchmark on a hand-built cache, as
# benchmarks/attention_kernel.py.
from tokenmill.engine.kernels.paged_attention import AttentionEntries, native_paged_attention

BLOCK = 16


def _int64(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=torch.int64)


def attention_call(shape, tokens: int, chunk: int):
    """A function running one layer's attention for a `tokens` prompt in chunks of
    `chunk`, and its causal FLOPs."""
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    blocks = -(-tokens // BLOCK)
    k = torch.randn(blocks + 1, kv_heads, head_dim, BLOCK).to(torch.bfloat16)
    v = torch.randn(blocks + 1, kv_heads, BLOCK, head_dim).to(torch.bfloat16)
    table = list(range(1, blocks + 1))
    random.Random(0).shuffle(table)
    q = torch.randn(tokens, heads, head_dim).to(torch.bfloat16)
    calls = []
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        entries = AttentionEntries(
            _int64([0]), _int64([n]), _int64([start + n]), _int64([table]),
            _int64([0, 1]), _int64([0]),
        )  # fmt: skip
        calls.append((q[start : start + n], entries))

    def run():
        for q_chunk, entries in calls:
            native_paged_attention(q_chunk, k, v, entries, head_dim**-0.5)

    return run, 4 * heads * head_dim * tokens * (tokens + 1) // 2


def linears_call(shape, tokens: int):
    """One layer's seven matmuls at `tokens` rows, weights packed as the engine packs
    them, and their FLOPs."""
    h, i = shape.hidden_size, shape.intermediate_size
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    mats = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, i), (h, i), (i, h)]
    packed = []
    for k_in, n_out in mats:
        x = torch.randn(tokens, k_in).to(torch.bfloat16)
        w = torch.randn(n_out, k_in).to(torch.bfloat16)
        packed.append((x, torch.ops.mkldnn._reorder_linear_weight(w, None)))

    def run():
        for x, w in packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return run, sum(2 * tokens * k_in * n_out for k_in, n_out in mats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--chunk", type=int, default=2048, help="the engine's chunk")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:  # the engine's own config parser
        (Path(folder) / "config.json").write_text(json.dumps(shape_config(args.shape)))
        shape = ModelShape.from_dir(folder)
    peak = measure_matmul_peak("bfloat16", llm_matmul_shapes(shape)).gflops
    print(
        f"{args.shape}: {shape.num_heads} heads / {shape.num_kv_heads} kv heads of "
        f"{shape.head_dim}, hidden {shape.hidden_size}; threads {torch.get_num_threads()}; "
        f"bf16 matmul peak {peak:.0f} GFLOP/s"
    )
    for tokens in args.tokens:
        one, att_flops = attention_call(shape, tokens, tokens)
        chunked, _ = attention_call(shape, tokens, args.chunk)
        linears, lin_flops = linears_call(shape, tokens)
        fns = [one, chunked, linears]
        for fn in fns:
            fn()
        t_one, t_chunked, t_lin = best_of(fns, args.repeat)
        for label, t_att in (("one chunk", t_one), (f"chunks of {args.chunk}", t_chunked)):
            total = t_att + t_lin
            print(
                f"{tokens:>6} tokens, {label:>15}: attention {t_att * 1e3:7.1f} ms "
                f"({att_flops / t_att / 1e9:5.0f} GFLOP/s, {att_flops / t_att / 1e9 / peak:4.0%} "
                f"of peak, {t_att / total:4.0%} of the layer's time), linears "
                f"{t_lin * 1e3:7.1f} ms ({lin_flops / t_lin / 1e9 / peak:4.0%} of peak); "
                f"both {(att_flops + lin_flops) / total / 1e9 / peak:4.0%} of peak"
            )


if __name__ == "__main__":
    main()
