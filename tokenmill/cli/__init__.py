"""The `tokenmill` command line. Each subcommand lives in its own module here.

Subcommands are imported when they are run (or listed by --help): the job options of
`run`, `flow` and `serve` come from the job definition, which imports the engine and
torch, and `tokenmill ledger show` needs none of that. `tokenmill run` says what it is
doing before that import, so its first line appears at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from importlib import import_module

import click

from tokenmill import __version__

# When the command started: `tokenmill run` stamps its stage lines from here (the
# import, for the command line; each call, where one process runs several).
STARTED = time.perf_counter()
_calls = 0

# command name -> (module, attribute holding the click command)
_SUBCOMMANDS = {
    "generate": ("generate", "generate"),
    "models": ("models", "models"),
    "bench": ("bench", "bench"),
    "run": ("run", "run"),
    "ledger": ("ledger", "ledger"),
    "serve": ("serve", "serve"),
    "flow": ("flow", "flow"),
    "batch-api": ("batch_api", "batch_api"),
}
# Flags after which `tokenmill run` prints nothing but its result (or its help).
_QUIET_FLAGS = {"--json", "--no-progress", "--help", "-h"}


class _LazyGroup(click.Group):
    """A group whose subcommands are imported when asked for."""

    def main(self, *args, **kwargs):
        global STARTED, _calls
        if _calls:
            STARTED = time.perf_counter()
        _calls += 1
        return super().main(*args, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _SUBCOMMANDS:
            return None
        module, attribute = _SUBCOMMANDS[name]
        return getattr(import_module(f"tokenmill.cli.{module}"), attribute)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and args[0] == "run" and not _QUIET_FLAGS & set(args):
            _announce_run(args[1:])
        return super().resolve_command(ctx, args)


def _announce_run(args: list[str]) -> None:
    """`tokenmill run`'s first line, on stderr, before the engine's imports."""
    given = args[:2] if len(args) >= 2 and not any(a.startswith("-") for a in args[:2]) else []
    where = f" {given[0]} -> {given[1]}" if given else ""
    print(f"{time.perf_counter() - STARTED:6.1f}s  tokenmill run{where}", file=sys.stderr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokenmill")
def main() -> None:
    """tokenmill: batch LLM inference over datasets, with a token-cost ledger."""


def entry_point() -> None:
    """The `tokenmill` console script: run the command, then leave without the
    interpreter's teardown.

    Tearing down an interpreter that has imported torch costs about 0.4 s (its operator
    registry is destroyed object by object) after the command's work is done; for a
    one-prompt `tokenmill generate` that is a tenth of the wall time. What exit must
    still do is done here: non-daemon threads are waited for by falling back to a normal
    exit, atexit handlers run (logging, temporary directories, Prefect), and the
    standard streams are flushed.
    """
    try:
        main()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(code)
