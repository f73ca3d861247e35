"""The experts' one native call (engine/kernels/moe.c) alone, at one MoE layer's shape:
this tree's build against another revision's, alternating within rounds in one process,
in CPU seconds (a busy machine's other work does not count), with oneDNN's bf16 matmul
and a read stream measured the same way in the same rounds - so the figures are shares
of what this machine gives one thread, comparable across runs.

    python benchmarks/moe_kernel.py --against main --rows 2048 --rounds 7
    python benchmarks/moe_kernel.py --rows 64 --threads 2          # a 64-row decode step
    python benchmarks/moe_kernel.py --dtype float32   # where the CPU lacks native bf16
    python benchmarks/moe_kernel.py --march x86-64-v3  # both as an AVX2 CPU (Zen 1) builds them

Defaults are OLMoE-1B-7B's layer (64 experts, 8 a token, hidden 2048, expert intermediate
1024) in bf16 (`--dtype float32`: activations, float weights and oneDNN's matmul in fp32,
the engine's dtype on CPUs without native bf16). Routing is a softmax over random logits, so a prompt's 2,048 tokens give
each expert about 256 rows. Each build is compiled here from its revision's
engine/kernels (moe.c with amx.c, the flags the engine uses); both must share tm_moe_args.
Prints, per build: the median CPU-ms of a call, active GFLOP per CPU-second and its share
of oneDNN's per CPU-second (prefill's roofline), and the bytes of the experts the rows
use per CPU-second against the read stream's (decode's bound). Set OMP_WAIT_POLICY=passive
with --threads > 1, so threads waiting at a barrier do not spin CPU time into the figures;
with `--march x86-64-v3`, ONEDNN_MAX_CPU_ISA=AVX2, so that oneDNN's matmul is the one an
AVX2 CPU gets too.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Below the front door: a kernel micro-benchmark - it builds two revisions' moe.c with the
# engine's compiler and flags and calls tm_moe on the packed layout, which no public
# API exposes.
from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.kernels.interface import MoEArgs
from tokenmill.engine.quant import mxfp4

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import TREE_KERNELS, build_library, revision_kernels  # noqa: E402


def build(kernels: Path, out: Path, march: str | None) -> ctypes.CDLL:
    """moe.c and amx.c from `kernels` into one library at `out`, as the engine builds them
    (for `march`'s CPUs where it is given)."""
    flags = (f"-march={march}",) if march else ()
    lib = build_library(kernels, ("moe.c", "amx.c"), out, flags)
    lib.tm_moe.argtypes = [ctypes.POINTER(MoEArgs)]
    lib.tm_moe.restype = ctypes.c_int
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", help="the git revision to compare with")
    parser.add_argument("--rows", type=int, default=2048, help="tokens in the call")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--format", default="float", choices=sorted(moe_kernel.WEIGHT_FORMATS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--march",
        help="build both for these CPUs instead of this one's (x86-64-v3: AVX2 and FMA, Zen 1)",
    )
    parser.add_argument(
        "--probe-mb",
        type=int,
        default=768,
        help="the read probe's buffer, past the last-level cache",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    E, H, inter, k, rows = args.experts, args.hidden, args.inter, args.top_k, args.rows
    dtype = getattr(torch, args.dtype)

    tmp = Path(tempfile.mkdtemp(prefix="moe-kernel-"))
    libs = {
        args.against: build(revision_kernels(args.against, tmp), tmp / "against.so", args.march),
        "this tree": build(TREE_KERNELS, tmp / "tree.so", args.march),
    }
    g = torch.Generator().manual_seed(0)
    # A few experts packed and repeated: the call reads E experts' bytes either way.
    few = min(E, 4)
    gate_up = (torch.randn(few, 2 * inter, H, generator=g) * 0.02).to(dtype)
    down = (torch.randn(few, H, inter, generator=g) * 0.02).to(dtype)
    if args.format == "mxfp4":  # as gpt-oss ships its experts: packed from their blocks
        packed = moe_kernel.PackedExperts.from_mxfp4(
            mxfp4.quantize(gate_up), mxfp4.quantize(down), dtype, "silu"
        )
    else:
        packed = moe_kernel.PackedExperts(gate_up, down, "silu", args.format)
    copies = -(-E // few)

    def stacked(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat(copies, *[1] * (t.dim() - 1))[:E].contiguous()

    weights = [stacked(t) for t in (packed.gate_up, packed.down)]
    scales = [stacked(t) for t in (packed.gate_up_scales, packed.down_scales)]
    x = torch.randn(rows, H, generator=g).to(dtype)

    def routing() -> tuple[torch.Tensor, torch.Tensor]:
        route, ids = torch.topk(torch.softmax(torch.randn(rows, E, generator=g), -1), k, -1)
        return route.float().contiguous(), ids.contiguous()

    # A routing of its own for every call: a decode step's few experts (8 of OLMoE's 64 at
    # one row: 100 MB) would otherwise stay in a large last-level cache from call to call,
    # and the figures would be the cache's, not the memory's.
    routes = [routing() for _ in range(2 * args.rounds + 3)]
    counts = torch.bincount(routes[0][1].reshape(-1), minlength=E)
    used = statistics.mean(
        int(torch.bincount(ids.reshape(-1), minlength=E).count_nonzero()) for _, ids in routes
    )
    print(
        f"{rows} rows, top {k} of {E} experts ({H} x {inter}, {args.format}, {args.dtype}), "
        f"{'-march=' + args.march + ' builds, ' if args.march else ''}{args.threads} "
        f"threads: {used:.1f} experts used (mean over the calls' routings), rows an expert {counts.float().mean():.1f} mean, "
        f"{int(counts.min())}-{int(counts.max())}"
    )
    outs = {}

    def call(name: str, route_index: int) -> float:
        route, ids = routes[route_index]
        out = torch.empty_like(x)
        call_args = MoEArgs(
            x=x.data_ptr(),
            expert_ids=ids.data_ptr(),
            expert_weights=route.data_ptr(),
            gate_up=weights[0].data_ptr(),
            down=weights[1].data_ptr(),
            gate_up_scales=None if scales[0] is None else scales[0].data_ptr(),
            down_scales=None if scales[1] is None else scales[1].data_ptr(),
            out=out.data_ptr(),
            rows=rows,
            top_k=k,
            num_experts=E,
            hidden=H,
            inter=inter,
            panel_cols=moe_kernel.PANEL_COLS,
            is_bf16=int(dtype == torch.bfloat16),
            weight_format=moe_kernel.WEIGHT_FORMATS[args.format],
            activation=moe_kernel.ACTIVATIONS["silu"],
            num_threads=args.threads,
        )
        start = time.process_time()
        status = libs[name].tm_moe(ctypes.byref(call_args))
        elapsed = time.process_time() - start
        if status != 0:
            raise RuntimeError(f"{name}: tm_moe returned {status}")
        outs[name] = out
        return elapsed

    a = torch.randn(512, 2048).to(dtype)
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1024, 2048).to(dtype), None)
    stream = torch.ones(args.probe_mb * (1 << 20) // 4)  # past the last-level cache

    def matmul_gflops() -> float:
        start = time.process_time()
        for _ in range(20):
            torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
        return 20 * 2 * 512 * 2048 * 1024 / (time.process_time() - start) / 1e9

    def read_gbs() -> float:
        start = time.process_time()
        stream.sum()
        return stream.numel() * 4 / (time.process_time() - start) / 1e9

    for name in libs:  # warm-up: pages touched, kept buffers grown
        call(name, 0)
    seconds = {name: [] for name in libs}
    peaks, reads = [], []
    for r in range(args.rounds):
        for turn, name in enumerate(list(libs) if r % 2 == 0 else list(libs)[::-1]):
            seconds[name].append(call(name, 1 + 2 * r + turn))
        peaks.append(matmul_gflops())
        reads.append(read_gbs())
    peak, read = statistics.median(peaks), statistics.median(reads)
    flops = 2 * rows * k * 3 * H * inter
    expert_bytes = packed.weight_bytes / few * used
    print(
        f"oneDNN {args.dtype} 512x2048x1024: {peak:.0f} GFLOP per CPU-s; read stream {read:.1f} GB per "
        f"CPU-s (medians of {args.rounds} rounds)"
    )
    for name, times in seconds.items():
        cpu = statistics.median(times)
        gflops = flops / cpu / 1e9
        print(
            f"{name:>10}: {cpu * 1e3:7.1f} CPU-ms, {gflops:5.0f} GFLOP per CPU-s = "
            f"{100 * gflops / peak:4.1f}% of oneDNN's; experts' {expert_bytes / 1e6:.0f} MB at "
            f"{expert_bytes / cpu / 1e9:.1f} GB per CPU-s = {read * cpu / (expert_bytes / 1e9):.2f}x "
            f"the read bound; rounds {[round(t * 1e3, 1) for t in times]}"
        )
    for name in libs:  # the same routing for both, to compare their outputs
        call(name, 0)
    first, second = outs.values()
    print(
        f"largest difference between the builds' outputs: {(first.float() - second.float()).abs().max():.3g}"
    )


if __name__ == "__main__":
    main()
