"""`tokenmill models`: list, inspect, convert and pull models."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.group("models")
def models() -> None:
    """List, inspect, convert and pull models (aliases, .gguf files, directories and
    Hugging Face Hub repo ids)."""


@models.command("list")
def list_command() -> None:
    """Show the built-in aliases, the converted models in the cache and the models in the
    Hugging Face cache."""
    from tokenmill.engine import cache_dir, list_models

    rows = [("NAME", "ARCHITECTURE", "PARAMS", "DTYPE", "SOURCE", "PATH")]
    for info in list_models():
        rows.append(
            (
                info.name,
                info.architecture or "-",
                _format_count(info.num_parameters),
                info.dtype or "-",
                info.source,
                str(info.path) if info.path else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    click.echo(f"\ncache: {cache_dir()}")


@models.command("info")
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit of a Hub repo id.")
def info_command(model: str, revision: str | None) -> None:
    """Describe MODEL (a directory, a .gguf file, an alias or a Hub repo id) without
    converting it."""
    from tokenmill.engine import ModelFilesError, checkpoint_info, model_info, weights_hash

    try:
        info = model_info(model, revision=revision)
    except ModelFilesError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"name:          {info.name}")
    click.echo(f"path:          {info.path}")
    if info.revision is not None:
        click.echo(f"revision:      {info.revision}")
    click.echo(f"architecture:  {info.architecture}")
    quantized = checkpoint_info(info.path) if info.path is not None and info.path.is_dir() else None
    # A quantized checkpoint packs several weights per stored element: count the model's.
    count = info.num_parameters if quantized is None else quantized.num_parameters
    exact = f" ({count:,})" if count is not None else ""
    click.echo(f"parameters:    {_format_count(count)}{exact}")
    if info.num_active_parameters is not None:
        active = info.num_active_parameters
        click.echo(f"active:        {_format_count(active)} ({active:,}) per token")
    click.echo(f"dtype:         {info.dtype}")
    if quantized is None and info.path is not None and info.path.is_dir():
        _echo_precision_bytes(info.path)
    click.echo(f"source:        {info.source}")
    if info.path is not None and info.path.is_dir():
        click.echo(f"weights hash:  {weights_hash(info.path)}")
    if quantized is not None:
        _echo_quantization(quantized)


@models.command("convert")
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Export an HF-layout directory of fp32 safetensors here (must be new or empty); "
    "default: only index the GGUF in the cache, which is all a run needs.",
)
def convert_command(gguf: Path, out: Path | None) -> None:
    """Index a GGUF file in the cache (config, tokenizer, tensor table: a run reads the
    weights from the file itself), or export it as an HF-layout model directory."""
    from tokenmill.engine import ModelFilesError, convert_gguf, resolve_model

    start = time.perf_counter()
    try:
        path = resolve_model(gguf) if out is None else convert_gguf(gguf, out)
    except (ModelFilesError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    done = "indexed" if out is None else "converted"
    click.echo(f"{done} {gguf.name} -> {path} in {time.perf_counter() - start:.1f} s")


@models.command("pull")
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
def pull_command(repo_id: str, revision: str | None) -> None:
    """Download REPO_ID ("org/name") from the Hugging Face Hub into the HF cache: config,
    tokenizer and safetensors files only. HF_HOME, HF_HUB_CACHE, HF_TOKEN and
    HF_HUB_OFFLINE apply."""
    from tokenmill.engine import ModelFilesError, is_hub_model, resolve_model

    if not is_hub_model(repo_id):
        raise click.ClickException(
            f"{repo_id!r} is not a Hub repo id (org/name); aliases and .gguf files need no pull"
        )
    start = time.perf_counter()
    try:
        path = resolve_model(repo_id, revision=revision)
    except ModelFilesError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"{repo_id} @ {path.name} -> {path} in {time.perf_counter() - start:.1f} s")


def _echo_quantization(quantized) -> None:
    """A checkpoint quantized by another tool: its format, bits, group sizes and the
    kernels its layers run on here - or why it is not read."""
    click.echo(f"quantization:  {quantized.summary}")
    if quantized.refusal is not None:
        click.echo(f"not loadable:  {quantized.refusal}")
        return
    groups = ", ".join("per-channel" if g is None else str(g) for g in quantized.group_sizes)
    click.echo(f"weight bits:   {', '.join(map(str, quantized.bits))}")
    click.echo(f"group size:    {groups}")
    for line in quantized.kernels:
        click.echo(f"kernels:       {line}")


def _echo_precision_bytes(path: Path) -> None:
    """The bytes the weights take in bf16 and each quantization mode (decoder linear
    layers quantized; embedding, norms and lm_head in bf16)."""
    from tokenmill.engine import load_config, precision_bytes

    try:
        sizes = precision_bytes(load_config(path))
    except ValueError:  # an architecture the engine does not build: nothing to count
        return
    listed = ", ".join(f"{mode} {size / 1e9:.2f} GB" for mode, size in sizes.items())
    click.echo(f"weights:       {listed}")


def _format_count(count: int | None) -> str:
    if count is None:
        return "-"
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
