"""How far int8 weights can take mixed64 on this CPU: the decoder's linear layers against
everything else, float and int8 engines alternating in one process.

    python benchmarks/int8_bound.py                      # bf16 against int8, 5 rounds
    python benchmarks/int8_bound.py --dtype float32 --rounds 7

int8 changes only the decoder's linear layers (L); attention, the KV cache, norms,
rotary, the lm_head, sampling and the engine (S, the rest of the run's wall time) run
the same code in both modes - except that float's S holds its SiLU-and-mul pass, which
int8's gate_up applies in its own epilogue (so inside L), and that int8's smaller
weights leave more of the cache to the rest. So the int8/float ratio is (L_float + S_float) /
(L_int8 + S_int8), and a target ratio R needs

    L_int8 <= (L_float + S_float) / R - S_int8,   i.e. int8 linears L_float / that
    times faster than the float ones.

Each round prints the measured split, that required speedup, and the ratio the run would
have had with int8 linears exactly 2x the float ones (the integer units' peak rate over
the bf16 ones on AMX and on AVX512-VNNI/BF16, and the weight bytes halved) and with
int8 linears that cost nothing. Every linear module inside the decoder layers is timed
(its forward replaced by a timed call, no hooks); on CPU every op is synchronous, so
wall time inside is its cost. Each engine runs mixed64 with its prefix cache emptied
first. Read the medians: the rounds of one run share the machine's mood.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import wraps

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import load_preset, warmup_prompts
from tokenmill.engine.quant import linear_kinds

# The integer units' peak multiply-adds per cycle over the bf16 units' (AMX: tdpbusd 1,024
# against tdpbf16ps 512; AVX512: vpdpbusd 4 a lane against vdpbf16ps 2), also the weight
# bytes' ratio: what a perfect int8 linear gains over a perfect bf16 one.
PEAK_INT8_OVER_BF16 = 2.0


@dataclass
class Round:
    wall_s: float
    linear_s: float

    @property
    def rest_s(self) -> float:
        return self.wall_s - self.linear_s


class LinearClock:
    """Wall time inside the decoder layers' linear modules of one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        timed: list[str] = []
        kinds = linear_kinds()
        for name, module in model.model.layers.named_modules():
            # The outermost linear only: a GGUF RowConcat holds GroupedLinears.
            if isinstance(module, kinds) and not any(
                name.startswith(outer + ".") for outer in timed
            ):
                module.forward = self._timed(module.forward)
                timed.append(name)
        if not timed:
            raise RuntimeError("no linear layers found in the decoder")

    def _timed(self, forward):
        @wraps(forward)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_round(llm: LLM, clock: LinearClock, prompts, params) -> Round:
    llm.engine.block_manager.forget_cache()
    clock.seconds = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    wanted = [p.max_tokens for p in params]
    if [len(o.outputs[0].token_ids) for o in outputs] != wanted:
        raise RuntimeError("a request generated a different number of tokens than asked")
    return Round(wall, clock.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--preset", default="mixed64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--target", type=float, default=1.5)
    args = parser.parse_args()

    engines = {
        args.dtype: LLM(dtype=args.dtype),
        "int8": LLM(dtype=args.dtype, quantization="int8"),
    }
    clocks = {mode: LinearClock(llm.engine.runner.model) for mode, llm in engines.items()}
    workload = load_preset(args.preset, engines["int8"].model_dir)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    for llm in engines.values():
        llm.generate(warmup_prompts(workload), SamplingParams(temperature=0.0, max_tokens=4))

    print(f"{args.preset}, {args.dtype} against int8, threads {torch.get_num_threads()}")
    print(
        "round  float: wall = L + S        int8: wall = L + S        ratio  L_f/L_8  "
        f"needed  at {PEAK_INT8_OVER_BF16:g}x  free"
    )
    rows = []
    for r in range(args.rounds):
        f, q = (
            run_round(llm, clocks[m], workload.prompt_ids, params) for m, llm in engines.items()
        )
        row = {
            "ratio": f.wall_s / q.wall_s,
            "speedup": f.linear_s / q.linear_s,
            "needed": _needed_speedup(f, q, args.target),
            "at_peak": f.wall_s / (f.linear_s / PEAK_INT8_OVER_BF16 + q.rest_s),
            "free": f.wall_s / q.rest_s,
        }
        rows.append(row)
        print(
            f"{r:5d}  {f.wall_s:6.2f} = {f.linear_s:5.2f} + {f.rest_s:5.2f}   "
            f"{q.wall_s:6.2f} = {q.linear_s:5.2f} + {q.rest_s:5.2f}   "
            f"{row['ratio']:5.2f}  {row['speedup']:7.2f}  {_fmt(row['needed']):>6}  "
            f"{row['at_peak']:7.2f}  {row['free']:4.2f}",
            flush=True,
        )
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(
        f"median: ratio {median['ratio']:.2f}; int8 linears {median['speedup']:.2f}x the "
        f"float ones; {args.target:g}x needs them {_fmt(median['needed'])}x; at "
        f"{PEAK_INT8_OVER_BF16:g}x the ratio would be {median['at_peak']:.2f}, with free "
        f"int8 linears {median['free']:.2f}"
    )


def _needed_speedup(f: Round, q: Round, target: float) -> float:
    """The int8 linears' speedup over the float ones that makes the ratio `target`, with
    the rest of each run as measured; inf where even free linears fall short."""
    budget = f.wall_s / target - q.rest_s
    return f.linear_s / budget if budget > 0 else float("inf")


def _fmt(x: float) -> str:
    return "never" if x == float("inf") else f"{x:.2f}"


if __name__ == "__main__":
    main()
