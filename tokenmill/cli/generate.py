"""`tokenmill generate`: answer a few prompts given on the command line."""

from __future__ import annotations

import click


@click.command("generate")
@click.argument("prompts", nargs=-1, required=True)
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file, alias or Hub repo id (default: smollm2-135m-instruct).",
)
@click.option(
    "--chat/--raw", default=True, show_default=True, help="Apply the model's chat template."
)
@click.option("--system", default=None, help="System prompt for --chat.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--dtype", default="auto", show_default=True)
def generate(prompts, model, chat, system, max_tokens, temperature, top_p, seed, dtype) -> None:
    """Generate completions for PROMPTS and print them."""
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype=dtype)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    # A base model (gemma3-270m) has no chat template: its prompts go as they are.
    if chat and llm.tokenizer.chat_template is not None:
        conversations = [
            ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": p}]
            for p in prompts
        ]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(list(prompts), params)
    for prompt, out in zip(prompts, outputs):
        click.echo(f"> {prompt}")
        click.echo(out.text.strip() if out.error is None else f"[error] {out.error}")
        click.echo("")
