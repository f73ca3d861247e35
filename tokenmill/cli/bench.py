"""`tokenmill bench`: tokenmill against baselines on one seeded workload, side by side."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from tokenmill.bench.image_workload import IMAGE_PRESETS
from tokenmill.bench.scale_shapes import SHAPE_NAMES
from tokenmill.bench.workload import PRESET_NAMES
from tokenmill.cli.options import key_values_callback
from tokenmill.pipelines.options import get_option


@click.command("bench")
@click.option(
    "--preset",
    "presets",
    default="mixed64",
    show_default=True,
    help=f"Comma-separated, run in turn within each round: {', '.join(PRESET_NAMES)}. "
    "extract64 compares constrained (JSON schema) and unconstrained generation; single8 "
    "runs its requests one at a time; embed4k (embed-smoke), run alone, compares "
    "embeddings with sentence-transformers and ONNX Runtime; images512 (images32 for a tower "
    "at a real model's size, images-smoke), run alone on a vision-language --model, compares "
    "image prompts with transformers' generate.",
)
@click.option(
    "--model",
    default=None,
    help=get_option("model").help,
)
@click.option(
    "--shape",
    type=click.Choice(SHAPE_NAMES),
    default=None,
    help="Instead of --model: a random-weight model at this published shape (real "
    "vocabulary; SmolLM2's tokenizer), built tensor by tensor on first use and cached.",
)
@click.option(
    "--shape-layers",
    type=click.IntRange(min=1),
    default=None,
    help="Build --shape with this many layers (default: the published count).",
)
@click.option(
    "--shape-dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="The --shape checkpoint's dtype.",
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
    help="Comma-separated int8, int8-head (its lm_head in int8 too), int4, gguf, gguf:FMT, "
    "gguf-head[:FMT] (gguf with its lm_head in int8): "
    "also run tokenmill with "
    "LLM(quantization=...), its float parts in the CPU's best float precision, and compare "
    "it with that; gguf:FMT runs the model's GGUF requantized to llama.cpp format FMT "
    "(e.g. gguf:Q4_0, made with llama-quantize).",
)
@click.option(
    "--checkpoint",
    "checkpoints",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="A directory of the same model quantized by another tool (compressed-tensors, "
    "GPTQ, AWQ, FP8): also run it as stored, its float parts in the CPU's best float "
    "precision, and compare it with each --quantization mode. Repeatable.",
)
@click.option(
    "--kv-cache-dtype",
    "kv_cache_dtypes",
    default=get_option("kv_cache_dtype").default,
    show_default=True,
    help=f"Comma-separated {', '.join(get_option('kv_cache_dtype').type.choices)}: run each "
    "tokenmill system with each KV cache dtype (int8 labelled -kv8) and compare each with "
    "its default-cache run.",
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
    help="GGUF file llama.cpp's formats are made from (default: the model's source GGUF).",
)
@click.option(
    "--llama-bin-dir",
    default=None,
    help="Directory of the built llama.cpp binaries (llama-server, llama-bench, "
    "llama-batched-bench, llama-quantize).",
)
@click.option(
    "--llama-server",
    default=None,
    help="llama-server binary for the llamacpp-server baseline (default: the one in "
    "--llama-bin-dir, else $TOKENMILL_LLAMA_SERVER).",
)
@click.option(
    "--llamacpp-formats",
    default="",
    help="Comma-separated llama.cpp formats (Q4_0, Q4_1, Q8_0, BF16, F16, F32, Q4_K): run "
    "each llama.cpp baseline on the model's GGUF in each (made with llama-quantize, cached). "
    "Default: the file as it is.",
)
@click.option(
    "--llama-server-slots",
    default="",
    help="llama-server's parallel slots (-np): one count, or several to try per preset "
    "before the rounds, keeping the fastest (default: 4,8,16,64).",
)
@click.option(
    "--llama-server-arg",
    "llama_server_args",
    multiple=True,
    metavar="ARG",
    help="Extra llama-server argument, e.g. --llama-server-arg=-fa --llama-server-arg=on; "
    "repeatable.",
)
@click.option(
    "--llama-reference/--no-llama-reference",
    default=False,
    help="Also run llama-bench (pp512, tg128) and llama-batched-bench on each format once.",
)
@click.option("--seed", type=int, default=None, help="Override the preset's workload seed.")
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=None,
    help="Run only each preset's first N requests (the same prompts the whole preset "
    "starts with), e.g. to keep a run at 8B to minutes; stated in the report.",
)
@click.option(
    "--max-output-tokens",
    "output_tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Cut each request's output to at most N tokens; stated in the report.",
)
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
    presets, model, shape, shape_layers, shape_dtype, baselines, dtype, quantizations, checkpoints, kv_cache_dtypes, repeat, hf_batch_size,
    device, threads, engine_args, vllm_args, vllm_python, llamacpp_gguf, llama_bin_dir,
    llama_server, llamacpp_formats, llama_server_slots, llama_server_args, llama_reference,
    seed, rows, output_tokens, timeout_s, json_path,
) -> None:  # fmt: skip
    """Benchmark tokenmill against baselines on the same prompts in one run.

    Systems alternate (A B C, A B C, ...), each run in its own process; the table shows
    medians, within-round ratios to each baseline, and the fraction of a matmul peak
    measured in the same run. Progress goes to stderr, the table to stdout.
    """
    from tokenmill.bench.harness import BenchConfig, run_benchmark
    from tokenmill.bench.systems import HF_BATCH_SIZES
    from tokenmill.bench.table import render_all

    names = [b.strip() for b in baselines.split(",") if b.strip() and b.strip() != "none"]
    preset_names = _split(presets)
    if shape is not None:
        model = _shape_model(model, shape, shape_layers, shape_dtype)
    elif shape_layers is not None:
        raise click.BadParameter("needs --shape", param_hint="--shape-layers")
    capped = [p for p in preset_names if p.startswith("embed") or p in IMAGE_PRESETS]
    if capped and (rows is not None or output_tokens is not None):
        raise click.BadParameter(
            f"--rows and --max-output-tokens cap the generation presets only, not {capped[0]}",
            param_hint="--rows",
        )
    if any(p.startswith("embed") for p in preset_names):
        if len(preset_names) != 1:
            raise click.BadParameter("an embedding preset runs alone", param_hint="--preset")
        preset = preset_names[0]
        if baselines == "hf":  # the generation presets' default: an embedding preset has its own
            names = ["st", "onnx"]
        dtypes = ("float32", "bfloat16") if dtype == "both" else (dtype,)
        _embedding_bench(preset, model, names, dtypes, repeat, threads, engine_args, json_path)
        return
    if any(p in IMAGE_PRESETS for p in preset_names):
        if len(preset_names) != 1:
            raise click.BadParameter("an image preset runs alone", param_hint="--preset")
        dtypes = ("float32", "bfloat16") if dtype == "both" else (dtype,)
        _image_bench(
            preset_names[0], model, names, dtypes, repeat, hf_batch_size, threads, engine_args,
            seed, timeout_s, json_path,
        )  # fmt: skip
        return
    try:
        slots = tuple(int(n) for n in _split(llama_server_slots))
    except ValueError:
        raise click.BadParameter(
            "counts, comma-separated", param_hint="--llama-server-slots"
        ) from None
    try:
        config = BenchConfig(
            presets=preset_names,
            model=model,
            dtypes=("float32", "bfloat16") if dtype == "both" else (dtype,),
            baselines=tuple(names),
            quantizations=tuple(q.strip() for q in quantizations.split(",") if q.strip()),
            checkpoints=tuple(checkpoints),
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
            llama_bin_dir=llama_bin_dir,
            llamacpp_formats=_split(llamacpp_formats),
            llama_server_slots=slots,
            llama_server_args=tuple(llama_server_args),
            llama_reference=llama_reference,
            seed=seed,
            rows=rows,
            output_tokens=output_tokens,
            timeout_s=timeout_s,
            command=shlex.join(["tokenmill", *sys.argv[1:]]),
        )
        reports = run_benchmark(config, log=lambda line: click.echo(line, err=True))
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from error
    render_all(reports)
    # One preset: its report; several: {"reports": [...]} in the order run.
    _write_json(
        json_path,
        reports[0].to_dict() if len(reports) == 1 else {"reports": [r.to_dict() for r in reports]},
    )
    if all(s.wall_s is None for r in reports for s in r.systems if not s.is_baseline):
        raise click.ClickException("no tokenmill run succeeded")


def _shape_model(model: str | None, shape: str, num_layers: int | None, dtype: str) -> str:
    """The directory of the --shape model, built now (before any timed run) if not cached."""
    from tokenmill.bench.scale_build import build_scale_model

    if model is not None:
        raise click.BadParameter(
            "--model and --shape name two models; give one", param_hint="--shape"
        )
    try:
        path = build_scale_model(shape, num_layers=num_layers, dtype=dtype)
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"{shape}: {path}", err=True)
    return str(path)


def _write_json(json_path, data: dict) -> None:
    if json_path is not None:
        json_path.write_text(json.dumps(data, indent=2))
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
    _write_json(json_path, report.to_dict())
    if all(s.wall_s is None for s in report.systems if not s.is_baseline):
        raise click.ClickException("no tokenmill run succeeded")


def _image_bench(
    preset, model, names, dtypes, repeat, hf_batch_size, threads, engine_args, seed, timeout_s,
    json_path,
) -> None:  # fmt: skip
    """An image preset: tokenmill against transformers' generate on the same images."""
    from tokenmill.bench.image_harness import (
        HF_IMAGE_BATCH_SIZES,
        ImageBenchConfig,
        render_image_report,
        run_image_benchmark,
    )

    try:
        config = ImageBenchConfig(
            preset=preset,
            model=model,
            dtypes=dtypes,
            baselines=tuple(names),
            repeat=repeat,
            hf_batch_sizes=(hf_batch_size,) if hf_batch_size else HF_IMAGE_BATCH_SIZES,
            threads=threads,
            engine_args=engine_args,
            seed=seed,
            timeout_s=timeout_s,
            command=shlex.join(["tokenmill", *sys.argv[1:]]),
        )
        report = run_image_benchmark(config, log=lambda line: click.echo(line, err=True))
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from error
    render_image_report(report)
    _write_json(json_path, report.to_dict())
    if all(s.wall_s is None for s in report.systems if not s.is_baseline):
        raise click.ClickException("no tokenmill run succeeded")


def _split(values: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in values.split(",") if v.strip())
