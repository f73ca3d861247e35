"""`tokenmill bench`: tokenmill against baselines on one seeded workload, side by side."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from tokenmill.bench.workload import PRESET_NAMES
from tokenmill.cli.options import key_values_callback
from tokenmill.pipelines.options import get_option


@click.command("bench")
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    default="mixed64",
    show_default=True,
    help="extract64 compares constrained (JSON schema) and unconstrained generation; embed4k "
    "(embed-smoke) compares embeddings with sentence-transformers and ONNX Runtime.",
)
@click.option(
    "--model",
    default=None,
    help=get_option("model").help,
)
@click.option(
    "--baseline",
    "baselines",
    default="hf",
    show_default=True,
    help="Comma-separated: hf, hf-bf16, llamacpp, llamacpp-server, vllm; for an embedding "
    "preset st (sentence-transformers), onnx (ONNX Runtime; both by default); 'none' for "
    "tokenmill alone.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "both"]),
    default="both",
    show_default=True,
    help="tokenmill's precision(s).",
)
@click.option(
    "--quantization",
    "quantizations",
    default="",
    help="Comma-separated int8, int4, gguf: also run tokenmill with LLM(quantization=...), "
    "its float parts in the CPU's best float precision, and compare it with that.",
)
@click.option(
    "--kv-cache-dtype",
    "kv_cache_dtypes",
    default="auto",
    show_default=True,
    help="Comma-separated auto, int8: run each tokenmill system with each KV cache dtype "
    "(int8 labelled -kv8) and compare each with its default-cache run.",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Rounds of A B C runs.",
)
@click.option(
    "--hf-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Pin HF's batch size (default: the best of 8, 16, 32, 64).",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch/llama.cpp threads (default: theirs).",
)
@click.option(
    "--engine-arg",
    "engine_args",
    multiple=True,
    callback=key_values_callback("--engine-arg"),
    metavar="KEY=VALUE",
    help="Extra tokenmill LLM(...) argument; repeatable.",
)
@click.option(
    "--vllm-arg",
    "vllm_args",
    multiple=True,
    callback=key_values_callback("--vllm-arg"),
    metavar="KEY=VALUE",
    help="Extra vllm.LLM(...) argument; repeatable.",
)
@click.option("--vllm-python", default=None, help="Python interpreter that has vLLM installed.")
@click.option(
    "--llamacpp-gguf",
    default=None,
    help="GGUF file for llama.cpp (default: the model's source GGUF).",
)
@click.option(
    "--llama-server",
    default=None,
    help="llama-server binary for the llamacpp-server baseline (default: $TOKENMILL_LLAMA_SERVER).",
)
@click.option(
    "--llama-server-slots",
    type=click.IntRange(min=1),
    default=None,
    help="llama-server's parallel slots (-np; default: one per request, at most 64).",
)
@click.option("--seed", type=int, default=None, help="Override the preset's workload seed.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=1800.0,
    show_default=True,
    help="Seconds allowed per run.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the full report as JSON.",
)
def bench(
    preset, model, baselines, dtype, quantizations, kv_cache_dtypes, repeat, hf_batch_size, device,
    threads, engine_args,
    vllm_args, vllm_python, llamacpp_gguf, llama_server, llama_server_slots, seed, timeout_s,
    json_path,
) -> None:  # fmt: skip
    """Benchmark tokenmill against baselines on the same prompts in one run.

    Systems alternate (A B C, A B C, ...), each run in its own process; the table shows
    medians, within-round ratios to each baseline, and the fraction of a matmul peak
    measured in the same run. Progress goes to stderr, the table to stdout.
    """
    from tokenmill.bench.harness import BenchConfig, run_benchmark
    from tokenmill.bench.systems import HF_BATCH_SIZES
    from tokenmill.bench.table import render

    names = [b.strip() for b in baselines.split(",") if b.strip() and b.strip() != "none"]
    if preset.startswith("embed"):
        if baselines == "hf":  # the generation presets' default: an embedding preset has its own
            names = ["st", "onnx"]
        dtypes = ("float32", "bfloat16") if dtype == "both" else (dtype,)
        _embedding_bench(preset, model, names, dtypes, repeat, threads, engine_args, json_path)
        return
    try:
        config = BenchConfig(
            preset=preset,
            model=model,
            dtypes=("float32", "bfloat16") if dtype == "both" else (dtype,),
            baselines=tuple(names),
            quantizations=tuple(q.strip() for q in quantizations.split(",") if q.strip()),
            kv_cache_dtypes=tuple(k.strip() for k in kv_cache_dtypes.split(",") if k.strip()),
            repeat=repeat,
            hf_batch_sizes=(hf_batch_size,) if hf_batch_size else HF_BATCH_SIZES,
            device=device,
            threads=threads,
            engine_args=engine_args,
            vllm_args=vllm_args,
            vllm_python=vllm_python,
            llamacpp_gguf=llamacpp_gguf,
            llama_server=llama_server,
            llama_server_slots=llama_server_slots,
            seed=seed,
            timeout_s=timeout_s,
            command=shlex.join(["tokenmill", *sys.argv[1:]]),
        )
        report = run_benchmark(config, log=lambda line: click.echo(line, err=True))
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from error
    render(report)
    _write_json(json_path, report)
    if all(s.wall_s is None for s in report.systems if not s.is_baseline):
        raise click.ClickException("no tokenmill run succeeded")


def _write_json(json_path, report) -> None:
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_dict(), indent=2))
        click.echo(f"wrote {json_path}", err=True)


def _embedding_bench(
    preset, model, names, dtypes, repeat, threads, engine_args, json_path
) -> None:  # fmt: skip
    """An embedding preset: tokenmill against sentence-transformers and ONNX Runtime."""
    from tokenmill.bench.embed_harness import (
        EmbedBenchConfig,
        render_embedding_report,
        run_embedding_benchmark,
    )

    try:
        config = EmbedBenchConfig(
            preset=preset,
            model=model or "all-minilm-l6-v2",
            dtypes=dtypes,
            baselines=tuple(names),
            repeat=repeat,
            threads=threads,
            engine_args=engine_args,
            command=shlex.join(["tokenmill", *sys.argv[1:]]),
        )
        report = run_embedding_benchmark(config, log=lambda line: click.echo(line, err=True))
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from error
    render_embedding_report(report)
    _write_json(json_path, report)
    if all(s.wall_s is None for s in report.systems if not s.is_baseline):
        raise click.ClickException("no tokenmill run succeeded")
