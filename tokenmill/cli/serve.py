"""`tokenmill serve INPUT OUTPUT --cron "0 3 * * *"`: a scheduled batch-inference deployment.

Registers the deployment `batch-inference/NAME` with the Prefect API (PREFECT_API_URL)
and serves it in this process until SIGTERM/Ctrl-C: scheduled runs and runs
triggered with `prefect deployment run 'batch-inference/NAME' --watch` execute here,
each in a subprocess, with their shards on the chosen cluster. Teams that deploy
with work pools use `examples/prefect.yaml` instead.
"""

from __future__ import annotations

from typing import Any

import click

from tokenmill.cli.flow import cluster_options, flow_parameters, task_runner_from
from tokenmill.cli.options import given_options, job_options
from tokenmill.pipelines.option_types import FLOW


@click.command("serve")
@click.argument("input_uri", metavar="INPUT")
@click.argument("output_uri", metavar="OUTPUT")
@click.option(
    "--name", default="tokenmill", show_default=True, help="Deployment name (batch-inference/NAME)."
)
@click.option(
    "--cron",
    required=True,
    help='Cron schedule, e.g. "0 3 * * *". Use {date} in OUTPUT for one output per run.',
)
@click.option("--timezone", default=None, help="Time zone of the cron schedule (default UTC).")
@click.option("--paused", is_flag=True, help="Register the schedule paused.")
@job_options(FLOW)
@cluster_options
@click.pass_context
def serve(
    ctx: click.Context,
    input_uri: str,
    output_uri: str,
    name: str,
    cron: str,
    timezone: str | None,
    paused: bool,
    **_: Any,
) -> None:
    """Serve the batch-inference flow for INPUT -> OUTPUT on a cron schedule."""
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    from tokenmill.flows.batch_flow import batch_inference

    params = flow_parameters(input_uri, output_uri, given_options(ctx, FLOW))
    runner = task_runner_from(ctx.params, params)
    try:
        schedule = Cron(cron, timezone=timezone)
    except ValueError as exc:
        raise click.UsageError(f"--cron/--timezone: {exc}") from None
    batch_inference.with_options(task_runner=runner).serve(
        name=name,
        schedule=schedule,
        parameters=params,
        paused=paused,
        description=f"tokenmill batch inference: {params['input']} -> {params['output']}",
        tags=["tokenmill"],
        # The flow is importable wherever tokenmill is installed; a file path is not.
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
