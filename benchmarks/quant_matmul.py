"""Quantized CPU matmul kernels against the float baselines, at SmolLM2's shapes.

Each candidate computes y = x @ W^T for x [rows, K] and W [N, K]; the kernels alternate
within each round (A B C ..., A B C ...) and the table shows medians over rounds, in
GOP/s (2 * rows * N * K / time; a multiply-add is 2 ops whatever the number format)
and as the best quantized candidate's speed over the best float one (bf16 on
oneDNN-packed weights where the CPU has it, else fp32: the engine's float path).

Candidates (those this torch build lacks are skipped with a note):
  fp32, bf16         the engine's PackedLinear (oneDNN, weight packed once; bf16 only
                     where oneDNN has a bf16 path: AVX-512 or AVX-NE-CONVERT)
  int8-dyn-onednn    per-tensor dynamic int8 activations x per-channel int8 weights,
                     torch.ops.onednn.qlinear_pointwise on a prepacked weight (PT2E's op);
                     the time includes quantizing x
  int8-rows-onednn   the int8 layer on oneDNN (per-row int8 activations from our
                     quantizer, oneDNN's int8 matmul at scale 1, the row scales applied
                     after; rows padded to few shapes): the layers' kernel where ours is
                     not built
  int8-rows-native   the int8 layer on our kernel (engine/kernels/int8_linear.c: AMX,
                     AVX512-VNNI or AVX2; row scales in its epilogue), where the library
                     has it
                     (both int8 layer rows: the time includes quantizing x)
  int8-dyn-torchao   torchao Int8DynamicActivationInt8WeightConfig (eager)
  int8-wo            torch._weight_int8pack_mm: int8 weights, bf16 activations
  int4-g32           torch._weight_int4pack_mm_for_cpu, group 32, bf16 activations
  int4-g32-layer     the int4 layer as it runs: that kernel below int4.UNPACK_MIN_ROWS
                     rows, from there the weights expanded to bf16 (int4_unpack.c) and
                     the bf16 matmul; where the library is built, N % 64 == 0 and
                     the CPU has native bf16 (AVX512-BF16 or AMX)
  q4-native          a GGUF Q4_0 layer on our 4-bit kernel (engine/kernels/q4_linear.c:
                     activations quantized per block of 32, integer dot products on the
                     nibbles) at every row count; the time includes quantizing x
  q4-tiles           the same blocks on AMX bf16 tiles (engine/kernels/q4_tiles.c: the
                     exact dequantized product, fp32 sums), where the CPU has them
  q4-expand          the same blocks expanded to bf16 (exactly) and the bf16 matmul
  q4-layer           the GGUF Q4_0 layer as it runs (gguf_linear.Q4Linear): q4-native, or
                     on AMX CPUs q4-tiles from gguf_linear.TILES_MIN_ROWS rows and
                     q4-expand from gguf_linear.EXPAND_MIN_ROWS
  fp8-channel        FP8 (e4m3) weights with a scale per output channel on the native fp8
                     kernel (engine/kernels/fp8_linear.c), bf16 activations: its bf16 dot
                     products (AMX or AVX512-BF16) where the CPU has them
  fp8-block128       the same with 128 x 128 scale blocks (Qwen's and DeepSeek's -FP8)
  fp8-plain          fp8-channel pinned to the kernel's plain loops (the fallback)
The last column is the best fp8 candidate's speed over bf16's (the share of the measured
bf16 rate it reaches).

Run:  python benchmarks/quant_matmul.py [--rows 1,16,64,256,2048] [--rounds 5] [--threads N]
          [--only fp32,bf16,int8-rows-native,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from tokenmill.bench.timing import time_per_call

SHAPES = {  # name -> (N, K) of SmolLM2-135M's projections
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


# Below the front door: a kernel micro-benchmark - each quantized layer class and native
# kernel is built and called directly on one weight.
def candidates(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], object]]:
    """name -> fn(x_fp32) for every kernel this build has, weight [N, K] fp32."""
    from tokenmill.engine.kernels import int8_linear as native_int8
    from tokenmill.engine.quant import int4, int8
    from tokenmill.engine.quant.packed_linear import PackedLinear

    n, k = weight.shape
    out: dict[str, Callable] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        linear.weight.data.copy_(weight)
        try:
            out[name] = _with_input(PackedLinear(linear), dtype)
        except RuntimeError as exc:  # oneDNN has no bf16 path on CPUs without AVX-512
            print(f"{name}: skipped ({exc})", file=sys.stderr)
    # The int8 layers take the engine's float dtype: bf16 where the CPU computes it, else fp32.
    act_dtype = torch.bfloat16 if "bf16" in out else torch.float32

    qweight, scale = int8.quantize_weight(weight)
    w_zero = torch.zeros(n, dtype=torch.int64)
    try:
        packed = torch.ops.onednn.qlinear_prepack(qweight, [rows, k])

        def onednn_int8(x: torch.Tensor) -> torch.Tensor:
            x_scale = float(x.abs().amax()) / 127 or 1.0
            qx = torch.round(x / x_scale).add_(128).clamp_(0, 255).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(
                qx, x_scale, 128, packed, scale, w_zero, None, 1.0, 0, x.dtype, "none", [], ""
            )

        out["int8-dyn-onednn"] = _with_input(onednn_int8, torch.bfloat16)
    except (AttributeError, RuntimeError) as exc:
        print(f"int8-dyn-onednn: skipped ({exc})", file=sys.stderr)

    if int8.kernel_name() is not None:
        layer = int8.Int8Linear.from_float(weight, kernel="onednn")
        out["int8-rows-onednn"] = _with_input(layer, act_dtype)
    # measured wherever it is built, AMX machines included: that is the choice at stake
    if native_int8.takes_shape(n, k):
        layer = int8.Int8Linear.from_float(weight, kernel="native")
        out["int8-rows-native"] = _with_input(layer, act_dtype)
    else:
        print("int8-rows-native: skipped (not built for this CPU)", file=sys.stderr)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
        model[0].weight.data.copy_(weight)
        quantize_(model, Int8DynamicActivationInt8WeightConfig())
        out["int8-dyn-torchao"] = _with_input(model, torch.bfloat16)
    except ImportError:
        print("int8-dyn-torchao: skipped (torchao is not installed)", file=sys.stderr)

    scale_bf16 = scale.to(torch.bfloat16)
    out["int8-wo"] = _with_input(
        lambda x: torch._weight_int8pack_mm(x, qweight, scale_bf16), torch.bfloat16
    )
    kernel4 = int4.Int4Linear.from_float(weight, group_size=32)
    kernel4.unpack_min_rows = None  # PyTorch's int4 kernel at every row count
    out["int4-g32"] = _with_input(kernel4, torch.bfloat16)
    layer4 = int4.Int4Linear.from_float(weight, group_size=32)
    if layer4.unpack_min_rows is not None:
        out["int4-g32-layer"] = _with_input(layer4, torch.bfloat16)
    out.update(q4_candidates(weight))
    out.update(fp8_candidates(weight))
    return out


def fp8_candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], object]]:
    """The fp8 kernel on the weight rounded to e4m3, per channel and in 128 x 128 blocks
    (each block's largest weight on 448, as llm-compressor's and DeepSeek's scales put it)."""
    from tokenmill.engine.kernels import fp8_linear

    n, k = weight.shape
    out: dict[str, Callable[[torch.Tensor], object]] = {}
    for name, block in (("fp8-channel", (1, k)), ("fp8-block128", (128, 128))):
        grid = (-(-n // block[0]), -(-k // block[1]))
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[:n, :k] = weight.abs()
        amax = padded.reshape(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
        scales = (amax / 448).clamp_min(1e-12)
        full = scales.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        codes = (weight / full).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()

        def run(x, codes=codes, scales=scales, block=block, isa=None):
            return fp8_linear.fp8_linear(x, codes, scales, block, None, max_isa=isa)

        out[name] = _with_input(run, torch.bfloat16)
        if name == "fp8-channel" and fp8_linear.native_isa() is not None:
            out["fp8-plain"] = _with_input(lambda x, run=run: run(x, isa="generic"), torch.bfloat16)
    return out


def q4_candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], object]]:
    """The Q4_0 layer's paths (where the native 4-bit kernel is built): the weight rounded
    to Q4_0 blocks (fp16 scale amax / 8 per 32 weights, nibbles q + 8), as a GGUF holds it."""
    from tokenmill.engine.kernels import q4_linear as native_q4
    from tokenmill.engine.quant.gguf_linear import Q4Linear

    n, k = weight.shape
    if not native_q4.takes_shape(n, k):
        print("q4-*: skipped (the native 4-bit kernel is not built for this CPU)", file=sys.stderr)
        return {}
    blocks = weight.reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(-1) / 8).clamp_min(1e-6).half().float()
    q = torch.round(blocks / scale[..., None]).clamp_(-8, 7).add_(8).reshape(n, k)
    packed = native_q4.pack_q4_weight(q.to(torch.uint8), scale, None)
    layer = Q4Linear(packed)
    tiles = {}
    if native_q4.tiles_available():
        tiles["q4-tiles"] = _with_input(
            lambda x: native_q4.q4_linear_tiles(x, packed), torch.bfloat16
        )
    return {
        "q4-native": _with_input(lambda x: native_q4.q4_linear(x, packed), torch.bfloat16),
        **tiles,
        "q4-expand": _with_input(
            lambda x: torch.nn.functional.linear(x, native_q4.unpack_q4_bf16(packed)),
            torch.bfloat16,
        ),
        "q4-layer": _with_input(layer, torch.bfloat16),
    }


def _with_input(fn: Callable, dtype: torch.dtype) -> Callable[[torch.Tensor], object]:
    return lambda x: fn(x.to(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated candidates to run (default: all); e.g. fp32,int8-rows-native "
        "where the bf16-activation ones run at a few GOP/s (no AVX-512)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    only = set(args.only.split(",")) if args.only else None
    torch.manual_seed(0)
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    from tokenmill.engine.kernels import int8_linear as native_int8
    from tokenmill.engine.quant import int8

    native = native_int8.native_int8_isa()
    print(
        f"# oneDNN int8 kernel: {int8.kernel_name()}; native int8 kernel: {native or 'none'}; "
        f"the layers choose: {int8.describe_kernel(int8.choose_kernel(960, 576))}"
    )
    from tokenmill.engine.kernels import fp8_linear

    print(f"# fp8 kernel: {fp8_linear.kernel_name()}")
    header = None
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        weight = torch.randn(n, k) * 0.05
        for rows in rows_list:
            x = torch.randn(rows, k)
            fns = candidates(weight, rows)
            if only:
                fns = {name: fn for name, fn in fns.items() if name in only}
            inputs = {name: x for name in fns}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(time_per_call(lambda fn=fn, x=inputs[name]: fn(x)))
            medians = {name: statistics.median(t) for name, t in times.items()}
            if header is None:
                header = list(fns)
                print(
                    "| shape | rows | "
                    + " | ".join(f"{h} GOP/s" for h in header)
                    + " | best quantized / best float | best fp8 / bf16 |"
                )
                print("|---|---:|" + "---:|" * (len(header) + 2))
            ops = 2 * rows * n * k
            cells = [f"{ops / medians[h] / 1e9:.0f}" if h in medians else "-" for h in header]
            quantized = [medians[h] for h in medians if h.startswith(("int", "q4", "fp8"))]
            floats = [medians[h] for h in ("fp32", "bf16") if h in medians]
            best = min(floats) / min(quantized) if quantized and floats else float("nan")
            fp8s = [medians[h] for h in medians if h.startswith("fp8")]
            share = medians["bf16"] / min(fp8s) if fp8s and "bf16" in medians else float("nan")
            print(
                f"| {shape_name} {n}x{k} | {rows} | "
                + " | ".join(cells)
                + f" | {best:.2f} | {share:.2f} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
