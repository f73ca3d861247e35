"""`tokenmill generate`: answer a few prompts given on the command line.

A front end to `tokenmill.generate`, so its prompts are sent as a notebook's or a
job's are (through the model's chat template unless `--raw`), and its options are the
job definition's (`pipelines/options.py`) - those of `tokenmill run` that apply to
prompts given as arguments rather than read from a dataset.
"""

from __future__ import annotations

import click

from tokenmill.cli.options import given_options, job_options
from tokenmill.pipelines.option_types import CLI, INPUT, NOTEBOOK, POOL

# A few prompts read on a terminal: short answers unless asked for more.
_DEFAULTS = {"max_tokens": 64}


@click.command("generate")
@click.argument("prompts", nargs=-1, required=True)
@job_options(CLI, only=NOTEBOOK, skip_sections=[INPUT, POOL], defaults=_DEFAULTS)
@click.pass_context
def generate(ctx: click.Context, prompts: tuple[str, ...], **_: object) -> None:
    """Generate completions for PROMPTS and print them."""
    from tokenmill.pipelines.notebook import generate as answer

    options = {**_DEFAULTS, **given_options(ctx)}
    try:
        results = answer(list(prompts), **options)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    for prompt, text, error in zip(prompts, results["output"], results["error"]):
        click.echo(f"> {prompt}")
        click.echo(text.strip() if error is None else f"[error] {error}")
        click.echo("")
