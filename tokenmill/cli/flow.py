"""`tokenmill flow run INPUT OUTPUT`: the batch job as a Prefect flow run.

Takes the same job options as `tokenmill run` (their definitions are reused from
that command, so the two never drift), plus where the shards run. The flow run is
recorded by the Prefect API that PREFECT_API_URL names, or by a temporary local
server when it is unset. The exit status is non-zero when the flow run fails.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tokenmill.cli.run import parse_storage_options
from tokenmill.cli.run import run as _run_command

# `tokenmill run` options that only make sense for a local, interactive run.
_NOT_FOR_FLOWS = frozenset({"progress", "as_json"})


def job_options(command: Callable) -> Callable:
    """Decorator: the job options of `tokenmill run`, plus `--storage-secret`."""
    params = [
        copy.copy(p)
        for p in _run_command.params
        if isinstance(p, click.Option) and p.name not in _NOT_FOR_FLOWS
    ]
    for param in params:
        if param.name == "storage_option":
            # Flow parameters are stored by the server: credentials go elsewhere.
            param.help = (
                "Non-secret fsspec storage option, e.g. endpoint_url=... (repeatable); "
                "credentials: --storage-secret or the workers' environment."
            )
    command = click.option(
        "--storage-secret",
        default=None,
        metavar="BLOCK",
        help="Prefect Secret block holding storage options with credentials (JSON object).",
    )(command)
    # What click.option does: params are collected bottom-up and reversed by @command.
    for param in reversed(params):
        command.__click_params__.append(param)
    return command


def cluster_options(command: Callable) -> Callable:
    """Decorator: where the shard tasks run (at most one of these)."""
    for decorator in reversed(
        [
            click.option(
                "--dask-workers",
                type=click.IntRange(min=1),
                default=None,
                help="Start a local Dask cluster with N worker processes.",
            ),
            click.option(
                "--dask-address",
                default=None,
                metavar="ADDR",
                help="Run shards on the Dask scheduler at ADDR (tcp://host:8786).",
            ),
            click.option(
                "--ray-address",
                default=None,
                metavar="ADDR",
                help="Run shards on the Ray cluster at ADDR (needs prefect-ray).",
            ),
        ]
    ):
        command = decorator(command)
    return command


def absolute(uri: str | None) -> str | None:
    """A local relative path made absolute; URLs unchanged.

    A flow run's tasks may run in another directory (a served deployment's
    subprocess, a Dask worker), where a relative path would name something else.
    """
    if uri is None or "://" in uri or os.path.isabs(uri):
        return uri
    return os.path.abspath(uri)


def flow_parameters(input_uri: str, output_uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The `batch_inference` parameters for parsed job options (consumes `opts`).

    Raises:
        click.UsageError: a malformed or credential-bearing option.
    """
    from tokenmill.flows.parameters import check_storage_options

    try:
        storage_options = parse_storage_options(opts.pop("storage_option"))
        engine_options = parse_storage_options(opts.pop("engine_option"), flag="--engine-option")
        check_storage_options(storage_options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    params = {
        "input": absolute(input_uri),
        "output": absolute(output_uri),
        "format": opts.pop("input_format"),
        "passthrough": list(opts.pop("passthrough")) or None,
        "stop": list(opts.pop("stop")) or None,
        "storage_options": storage_options or None,
        "engine_options": engine_options or None,
        # The rest are named as the flow's parameters are (tests hold the two in step).
        **{k: opts.pop(k) for k in list(opts)},
    }
    params["ledger_dataset"] = absolute(params.get("ledger_dataset"))
    if params.get("model") and Path(params["model"]).exists():
        params["model"] = str(Path(params["model"]).resolve())
    # An unset option takes the flow's default (and keeps the run's parameters short).
    return {k: v for k, v in params.items() if v is not None or k in ("input", "output")}


def task_runner_from(opts: dict[str, Any]):
    """The task runner for the cluster options in `opts` (consumed)."""
    from tokenmill.flows.runners import make_task_runner

    try:
        return make_task_runner(
            dask_workers=opts.pop("dask_workers"),
            dask_address=opts.pop("dask_address"),
            ray_address=opts.pop("ray_address"),
        )
    except (ValueError, RuntimeError) as exc:
        raise click.UsageError(str(exc)) from None


@click.group("flow")
def flow() -> None:
    """Run tokenmill jobs as Prefect flows (PREFECT_API_URL; ephemeral when unset)."""


@flow.command("run")
@click.argument("input_uri", metavar="INPUT")
@click.argument("output_uri", metavar="OUTPUT")
@job_options
@cluster_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the ledger as JSON instead of a summary table."
)
def run_flow(input_uri: str, output_uri: str, as_json: bool, **opts: Any) -> None:
    """Run the batch-inference flow over INPUT, writing results and ledger to OUTPUT."""
    from tokenmill.cli.run import print_summary
    from tokenmill.flows.batch_flow import batch_inference

    runner = task_runner_from(opts)
    params = flow_parameters(input_uri, output_uri, opts)
    state = batch_inference.with_options(task_runner=runner)(**params, return_state=True)
    if not state.is_completed():
        # The flow run's logs (Prefect UI / API) hold the traceback; say why in one line.
        raise click.ClickException(f"flow run {state.name}: {state.message}")
    ledger = state.result()
    if as_json:
        click.echo(json.dumps(ledger.to_dict(), indent=2))
    else:
        print_summary(ledger, ledger.output_uri)
