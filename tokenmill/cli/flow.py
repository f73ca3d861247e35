"""`tokenmill flow run INPUT OUTPUT`: the batch job as a Prefect flow run.

Takes the flow's parameters as options - every option of `tokenmill run` and
`--storage-secret`, all derived from the job definition (`pipelines/options.py`) -
plus where the shards run. The flow run is
recorded by the Prefect API that PREFECT_API_URL names, or by a temporary local
server when it is unset. The exit status is non-zero when the flow run fails.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tokenmill.cli.options import given_options, job_options
from tokenmill.pipelines.option_types import FLOW
from tokenmill.pipelines.options import get_option


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


def flow_parameters(input_uri: str, output_uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """The `batch_inference` parameters for the job options a user gave.

    Repeated values become lists (flow parameters are JSON); local relative paths become
    absolute, since a flow's tasks may run in another directory.

    Raises:
        click.UsageError: a credential among the storage options.
    """
    from tokenmill.flows.parameters import check_storage_options

    try:
        check_storage_options(options.get("storage_options"))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    params: dict[str, Any] = {"input": absolute(input_uri), "output": absolute(output_uri)}
    for name, value in options.items():
        path = get_option(name).path
        if path == "always":
            value = absolute(value)
        elif path == "if_exists" and isinstance(value, dict):  # e.g. adapters by name
            value = {k: _resolved_if_exists(v) for k, v in value.items()}
        elif path == "if_exists" and value and Path(value).exists():  # else e.g. an alias
            value = str(Path(value).resolve())
        params[name] = list(value) if isinstance(value, tuple) else value
    return params


def _resolved_if_exists(value: Any) -> Any:
    """A local path as an absolute one; anything else (a repo id) as it is."""
    if isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value


def task_runner_from(params: dict[str, Any], job: dict[str, Any]):
    """The task runner for the cluster options among a command's parsed `params`; a
    local Dask cluster's workers get memory limits sized from the engine the `job`
    (its flow parameters) runs."""
    from tokenmill.flows.runners import make_task_runner

    try:
        return make_task_runner(
            dask_workers=params["dask_workers"],
            dask_address=params["dask_address"],
            ray_address=params["ray_address"],
            engine_memory=engine_memory(job) if params["dask_workers"] else None,
        )
    except (ValueError, RuntimeError) as exc:
        raise click.UsageError(str(exc)) from None


def engine_memory(job: dict[str, Any]):
    """The memory plan of the engine a job's flow parameters build (None on a GPU: its
    cache is sized from the device after the load), planned without loading it."""
    from tokenmill.pipelines.forecast import engine_planner
    from tokenmill.pipelines.spec import JobSpec

    options = {k: v for k, v in job.items() if k not in ("input", "output", "storage_secret")}
    spec = JobSpec(job["input"], job["output"], **options)
    return engine_planner(spec.llm_options, spec.model)([]).shape.memory


@click.group("flow")
def flow() -> None:
    """Run tokenmill jobs as Prefect flows (PREFECT_API_URL; ephemeral when unset)."""


@flow.command("run")
@click.argument("input_uri", metavar="INPUT")
@click.argument("output_uri", metavar="OUTPUT")
@job_options(FLOW)
@cluster_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the ledger as JSON instead of a summary table."
)
@click.pass_context
def run_flow(ctx: click.Context, input_uri: str, output_uri: str, as_json: bool, **_: Any) -> None:
    """Run the batch-inference flow over INPUT, writing results and ledger to OUTPUT."""
    from tokenmill.cli.run import print_forecast, print_summary
    from tokenmill.flows.batch_flow import batch_inference

    params = flow_parameters(input_uri, output_uri, given_options(ctx, FLOW))
    runner = task_runner_from(ctx.params, params)
    state = batch_inference.with_options(task_runner=runner)(**params, return_state=True)
    if not state.is_completed():
        # The flow run's logs (Prefect UI / API) hold the traceback; say why in one line.
        raise click.ClickException(f"flow run {state.name}: {state.message}")
    result = state.result()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    elif ctx.params["dry_run"]:
        print_forecast(result)
    else:
        print_summary(result, result.output_uri)
