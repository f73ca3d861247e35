"""`tokenmill ledger show URI`: the jobs recorded in a ledger dataset, as a table.

A job that had a dry run shows its forecast beside the actuals: forecast cost (the
estimate, or the bounds without calibration) and forecast device seconds.
"""

from __future__ import annotations

import json

import click

from tokenmill.cli.options import key_values_callback
from tokenmill.pipelines import report

# Shown by default, with their short headers; --all shows every ledger field.
DEFAULT_COLUMNS = {
    "started_at": "started (UTC)",
    "job_id": "job",
    "task": "task",
    "model": "model",
    "rows_ok": "ok",
    "rows_failed": "failed",
    "rows_deduplicated": "dedup",
    "prompt_tokens": "prompt tok",
    "cached_tokens": "cached tok",
    "completion_tokens": "output tok",
    "forecast_completion_tokens": "output tok fcst",
    "prefix_cache_hit_rate": "hit rate",
    "device_seconds": "device s",
    "forecast_seconds": "device s fcst",
    "throughput_tokens_per_s": "tok/s",
    "cost_total": "cost",
    "forecast_cost": "cost fcst",
}
# Shown only when some job in the listing has them: column -> the field that says so.
OPTIONAL = {
    "rows_deduplicated": "rows_deduplicated",
    "forecast_completion_tokens": "forecast_completion_tokens",
    "forecast_seconds": "forecast_seconds",
    "forecast_cost": "forecast_cost_min",
}
SUMMED = (
    "rows_ok",
    "rows_failed",
    "rows_deduplicated",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "device_seconds",
    "cost_total",
)


@click.group("ledger")
def ledger() -> None:
    """Inspect job ledgers."""


def _cell(value, column: str = "", row: dict | None = None) -> str:
    if column in ("cost_total", "forecast_cost") and row is not None:
        if not report.prices_given(row):
            return report.NO_PRICES
        if column == "forecast_cost":
            return _forecast_cost(row)
        return report.money(value)
    if value is None:
        return "-"
    if column == "started_at":
        return str(value)[:19].replace("T", " ")
    if column == "prefix_cache_hit_rate":
        return f"{value:.1%}"
    if column in ("device_seconds", "forecast_seconds"):
        return f"{value:,.1f}"
    if column == "throughput_tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _forecast_cost(row: dict) -> str:
    low, high, estimate = (
        row.get("forecast_cost_min"),
        row.get("forecast_cost_max"),
        row.get("forecast_cost"),
    )
    if low is None:
        return "-"
    bounds = f"{report.money(low)}-{report.money(high)}"
    return f"~{report.money(estimate)} ({bounds})" if estimate is not None else bounds


def _total(rows: list[dict], column: str) -> str:
    if column == "cost_total":
        if not any(report.prices_given(r) for r in rows):
            return report.NO_PRICES
        return report.money(sum(r.get(column) or 0 for r in rows))
    return _cell(sum(r.get(column) or 0 for r in rows), column)


@ledger.command("show")
@click.argument("uri")
@click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    callback=key_values_callback("--storage-option"),
    metavar="KEY=VALUE",
    help="fsspec storage option (repeatable).",
)
@click.option("--all", "all_columns", is_flag=True, help="Show every ledger field.")
@click.option("--json", "as_json", is_flag=True, help="Print rows as JSON lines.")
def show(uri, storage_options, all_columns, as_json) -> None:
    """Print the ledger dataset at URI (or one job's ledger.json) as a table."""
    from rich.console import Console
    from rich.table import Table

    from tokenmill.connectors import read_json
    from tokenmill.pipelines.output import read_ledger_dataset

    try:
        if uri.endswith(".json"):
            rows = [read_json(uri, storage_options)]
        else:
            rows = read_ledger_dataset(uri, storage_options).to_pylist()
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo(f"no jobs recorded in {uri}")
        return
    if all_columns:
        columns = list(rows[0])
    else:
        columns = [
            c
            for c in DEFAULT_COLUMNS
            if c in rows[0] and (c not in OPTIONAL or any(r.get(OPTIONAL[c]) for r in rows))
        ]
    cells = [[_cell(row.get(c), c, row) for c in columns] for row in rows]
    if len(rows) > 1:
        totals = [
            "total" if i == 0 else _total(rows, c) if c in SUMMED else ""
            for i, c in enumerate(columns)
        ]
        cells.append(totals)
    table = Table(title=f"{len(rows)} job(s)")
    headers = [DEFAULT_COLUMNS.get(c, c) if not all_columns else c for c in columns]
    for header in headers:
        table.add_column(header, no_wrap=True)
    for line in cells:
        table.add_row(*line)
    # Wide enough for the whole table when not on a terminal (pipes, files, tests).
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headers)]
    console = Console()
    if not console.is_terminal:
        console = Console(width=sum(widths) + 3 * len(widths) + 1)
    console.print(table)
