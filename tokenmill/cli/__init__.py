"""The `tokenmill` command line. Each subcommand lives in its own module here."""

from __future__ import annotations

from importlib import import_module

import click

from tokenmill import __version__

# module name -> attribute holding the click command; imported when the CLI starts,
# heavy libraries (torch, prefect) are imported inside the commands themselves.
_SUBCOMMANDS = {
    "generate": "generate",
    "models": "models",
    "bench": "bench",
    "run": "run",
    "ledger": "ledger",
    "serve": "serve",
    "flow": "flow",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokenmill")
def main() -> None:
    """tokenmill: batch LLM inference over datasets, with a token-cost ledger."""


for _module, _attr in _SUBCOMMANDS.items():
    main.add_command(getattr(import_module(f"tokenmill.cli.{_module}"), _attr))
