"""`tokenmill batch-api --store DIR_OR_URL`: a self-hosted OpenAI Batch API.

Serves /v1/files, /v1/batches and /v1/models (docs/batch-api.md) with uvicorn until
SIGTERM or Ctrl-C. Keys come from TOKENMILL_API_KEYS or --api-keys-file; the job
options every batch runs with are the job definition's, given as `--option NAME=VALUE`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from tokenmill.cli.options import parse_key_values

API_KEYS_ENV = "TOKENMILL_API_KEYS"


@click.command("batch-api")
@click.option("--store", required=True, help="Files and batches: a directory or an fsspec URL.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--model",
    "models",
    multiple=True,
    help="A model to serve (repeatable; the first answers lines that name none). "
    "Default: the embedded default model.",
)
@click.option(
    "--lora",
    multiple=True,
    metavar="NAME=PATH_OR_REPO",
    help="A LoRA adapter of the first model, named by a line's body.model (repeatable).",
)
@click.option(
    "--database-url",
    default=None,
    help="The state database: sqlite:///PATH or postgresql://... "
    "(default: SQLite in a local store).",
)
@click.option(
    "--api-keys-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help=f"API keys, one a line (or set {API_KEYS_ENV}, comma separated).",
)
@click.option("--no-auth", is_flag=True, help="Serve without keys (loopback hosts only).")
@click.option(
    "--runner",
    type=click.Choice(["local", "prefect"]),
    default="local",
    show_default=True,
    help="local: in this process, one warm engine per model. prefect: each batch a flow "
    "run of the batch-inference flow, on the deployment's workers.",
)
@click.option(
    "--prefect-deployment",
    default="batch-inference/batch-api",
    show_default=True,
    help="With --runner prefect: the deployment whose runs do the work.",
)
@click.option(
    "--option",
    "job_option_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="A job option for every batch (pipelines/options.py), e.g. max_tokens=512, "
    "price_input=0.15, dtype=bfloat16, max_n=16 (repeatable).",
)
@click.option(
    "--storage-options",
    default=None,
    metavar="JSON",
    help="The store's fsspec options as JSON (an endpoint, a profile); keep credentials "
    "in the environment.",
)
@click.option("--max-upload-bytes", type=click.IntRange(min=1), default=None)
@click.option("--max-lines", type=click.IntRange(min=1), default=None)
@click.option("--max-concurrent-batches", type=click.IntRange(min=1), default=None)
@click.option("--max-queued-lines-per-key", type=click.IntRange(min=1), default=None)
@click.option(
    "--completion-window",
    default="24h",
    show_default=True,
    help="The time a batch has (e.g. 72h on slow hardware); reported in expires_at.",
)
@click.option(
    "--retention",
    default="30d",
    show_default=True,
    help="How long files and finished batches' work stay on the store.",
)
def batch_api(
    store: str,
    host: str,
    port: int,
    models: tuple[str, ...],
    lora: tuple[str, ...],
    database_url: str | None,
    api_keys_file: Path | None,
    no_auth: bool,
    runner: str,
    prefect_deployment: str,
    job_option_pairs: tuple[str, ...],
    storage_options: str | None,
    completion_window: str,
    retention: str,
    **limits: Any,
) -> None:
    """Serve the OpenAI Batch API (/v1/files, /v1/batches, /v1/models) over STORE."""
    import uvicorn

    from tokenmill.batch_api.app import create_app
    from tokenmill.batch_api.settings import ServerSettings, parse_duration, read_api_keys

    keys = read_api_keys(os.environ.get(API_KEYS_ENV, ""))
    if api_keys_file is not None:
        keys += read_api_keys(api_keys_file.read_text(encoding="utf-8"))
    try:
        settings = ServerSettings(
            store=store,
            models=models,
            lora=parse_key_values(lora, flag="--lora") or None,
            database_url=database_url,
            api_keys=keys,
            no_auth=no_auth,
            host=host,
            runner=runner,
            prefect_deployment=prefect_deployment,
            storage_options=json.loads(storage_options) if storage_options else None,
            job_options=parse_key_values(job_option_pairs, flag="--option"),
            completion_window_s=parse_duration(completion_window),
            retention_s=parse_duration(retention),
            **{name: value for name, value in limits.items() if value is not None},
        )
        app = create_app(settings)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(
        f"tokenmill batch-api on http://{host}:{port}/v1 "
        f"({len(settings.api_keys)} key(s){', no auth' if no_auth else ''}; "
        f"runner {runner}; models: {', '.join(m.id for m in app.state.server.models.models)})",
        err=True,
    )
    # The access log names methods and paths, never bodies.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
