"""Perplexity of a held-out English text, per precision and quantization, from prompt
log-probabilities; and transformers' loss on the same tokens as the reference.

The text (benchmarks/data/heldout_en.txt, written for this project, CC0) is scored as
one row per mode with `tokenmill.score` (a scoring job's own path: raw text, prompt
log-probabilities, nothing generated): perplexity = exp(-mean logprob of tokens 1..n-1).
transformers gets the same tokens. Each mode runs in its own process so its peak RSS is
its own.

Run:  python benchmarks/perplexity.py [--modes fp32,bf16,int8,int4,gguf,hf-fp32] [--model M]
("-kv8" modes, e.g. bf16-kv8 or int8-kv8, keep the KV cache in int8: kv_cache_dtype="int8";
int8-head and gguf-head are int8 and gguf with the lm_head in int8 too: quantize_lm_head=True)
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "heldout_en.txt"
# mode -> (dtype, quantization) for tokenmill; "<mode>-kv8" adds an int8 KV cache
MODES = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("auto", "int8"),
    "int8-head": ("auto", "int8"),
    "int4": ("auto", "int4"),
    "gguf": ("auto", "gguf"),
    "gguf-head": ("auto", "gguf"),
}


def token_ids(model: str | None) -> list[int]:
    from tokenmill.engine import Tokenizer, resolve_model

    tokenizer = Tokenizer.from_dir(resolve_model(model))
    return tokenizer.encode_batch([TEXT.read_text(encoding="utf-8")])[0]


def score_tokenmill(mode: str, model: str | None) -> dict:
    import tokenmill
    from tokenmill import LLM
    from tokenmill.engine import weight_bytes

    dtype, quantization = MODES[mode.removesuffix("-kv8")]
    start = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        enable_prefix_caching=False,
        kv_cache_dtype="int8" if mode.endswith("-kv8") else "auto",
        quantize_lm_head=mode.removesuffix("-kv8").endswith("-head"),
    )
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    row = tokenmill.score([TEXT.read_text(encoding="utf-8")], llm=llm).row(0, named=True)
    score_s = time.perf_counter() - start
    if row["error"] is not None:
        raise RuntimeError(row["error"])
    num_tokens = row["prompt_tokens"]
    if num_tokens != len(token_ids(model)):  # transformers must see the same tokens
        raise RuntimeError(f"scored {num_tokens} tokens, tokenized {len(token_ids(model))}")
    return {
        "mode": mode,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "num_tokens": num_tokens,
        "nll": -row["prompt_logprob_sum"] / (num_tokens - 1),
        "weight_mb": weight_bytes(llm.engine.runner.model) / 1e6,
        "load_s": load_s,
        "score_s": score_s,
    }


def score_transformers(model: str | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.engine import resolve_model

    ids = token_ids(model)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    return {
        "mode": "hf-fp32",
        "dtype": "float32",
        "num_tokens": len(ids),
        "nll": float(loss),
        "weight_mb": sum(p.numel() * p.element_size() for p in hf.parameters()) / 1e6,
        "load_s": None,
        "score_s": time.perf_counter() - start,
    }


def run_child(mode: str, model: str | None) -> dict:
    command = [sys.executable, __file__, "--child", mode]
    if model:
        command += ["--model", model]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"mode": mode, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="hf-fp32,fp32,bf16,int8,int4,gguf")
    parser.add_argument("--model", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.child:
        result = (
            score_transformers(args.model)
            if args.child == "hf-fp32"
            else score_tokenmill(args.child, args.model)
        )
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    results = [run_child(mode, args.model) for mode in args.modes.split(",")]
    by_mode = {r["mode"]: r for r in results if "nll" in r}
    print(
        f"# {TEXT.name}: {next(iter(by_mode.values()))['num_tokens']} tokens"
        if by_mode
        else "# no mode ran"
    )
    print(
        "| mode | compute dtype | perplexity | vs bf16 | vs fp32 | weights MB | peak RSS MB "
        "| score s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if "nll" not in r:
            print(f"| {r['mode']} | failed: {r['error']} |")
            continue
        ppl = math.exp(r["nll"])
        rel = {
            base: f"{ppl / math.exp(by_mode[base]['nll']) - 1:+.2%}" if base in by_mode else "-"
            for base in ("bf16", "fp32")
        }
        print(
            f"| {r['mode']} | {r['dtype']} | {ppl:.4f} | {rel['bf16']} | {rel['fp32']} "
            f"| {r['weight_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['score_s']:.2f} |"
        )
    if "hf-fp32" in by_mode and "fp32" in by_mode:
        diff = math.exp(by_mode["fp32"]["nll"]) / math.exp(by_mode["hf-fp32"]["nll"]) - 1
        print(f"\ntokenmill fp32 perplexity vs transformers fp32 loss: {diff:+.4%}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
