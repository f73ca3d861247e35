"""`tokenmill run INPUT OUTPUT`: a batch job from the command line, with a progress bar.

Results go to OUTPUT/results/ (one part per shard), the ledger to OUTPUT/ledger.json
and to the ledger dataset (`--ledger-dataset`, env TOKENMILL_LEDGER_DATASET, default
OUTPUT/ledger/). Rerunning the same command resumes a killed job. `--dry-run` plans
the job and prints its forecast instead (`pipelines/forecast.py`).
"""

from __future__ import annotations

import json

import click

import tokenmill.cli
from tokenmill.cli.options import given_options, job_options
from tokenmill.pipelines.option_types import CLI
from tokenmill.pipelines.report import NO_PRICES, money, prices_given


def print_summary(ledger, output: str) -> None:
    """The ledger's headline figures as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value, spec=",", unit=""):
        return "-" if value is None else f"{value:{spec}}{unit}"

    priced = prices_given(ledger)
    table = Table(title=f"job {ledger.job_id}", show_header=False)
    rows = [
        ("task", ledger.task),
        ("model", f"{ledger.model} ({ledger.weights_hash[:12]})"),
        ("rows", _rows_line(ledger)),
        ("shards", f"{ledger.num_shards} ({ledger.num_shards_run} computed by this run)"),
        (
            "tokens",
            f"{ledger.prompt_tokens:,} prompt ({ledger.cached_tokens:,} cached), "
            f"{ledger.completion_tokens:,} completion",
        ),
        ("prefix cache hit rate", f"{ledger.prefix_cache_hit_rate:.1%}"),
        ("device", f"{ledger.device or '-'}, {ledger.device_seconds:.2f} s"),
        (
            "throughput",
            fmt(ledger.throughput_tokens_per_s, ",.0f", " tok/s")
            + f" ({fmt(ledger.output_tokens_per_s, ',.0f', ' output tok/s')}, "
            + f"{fmt(ledger.throughput_rows_per_s, ',.1f', ' rows/s')})",
        ),
        (
            "latency p50/p95/p99",
            " / ".join(
                fmt(v, ".3f", " s")
                for v in (ledger.latency_p50_s, ledger.latency_p95_s, ledger.latency_p99_s)
            ),
        ),
    ]
    if priced:
        rows += [
            (
                "cost (tokens)",
                f"{money(ledger.cost_total)} = input {money(ledger.cost_input)} + cached "
                f"{money(ledger.cost_cached_input)} + output {money(ledger.cost_output)}",
            ),
            (
                "cost per 1K requests / 1M tokens",
                f"{money(ledger.cost_per_1k_requests)} / {money(ledger.cost_per_1m_tokens)}",
            ),
        ]
    else:
        rows.append(("cost", NO_PRICES))
    if ledger.cost_device is not None:
        rows.append(("cost (device time)", money(ledger.cost_device)))
    if ledger.forecast_prompt_tokens is not None:
        rows.append(("forecast (dry run)", _forecast_versus_actual(ledger, priced)))
    rows.append(
        ("results", f"{output.rstrip('/')}/results/  ledger: {output.rstrip('/')}/ledger.json")
    )
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def _rows_line(ledger) -> str:
    line = f"{ledger.rows_ok:,} ok, {ledger.rows_failed:,} failed"
    if ledger.rows_deduplicated:
        line += f" ({ledger.rows_deduplicated:,} duplicates computed once)"
    if ledger.rows_read is not None:
        line += f"; {ledger.rows_read:,} records read"
        if ledger.rows_skipped_blank:
            line += f", {ledger.rows_skipped_blank:,} of them blank and skipped"
        if not ledger.rows_read:
            line += " (the input is empty)"
    return line


def _forecast_versus_actual(ledger, priced: bool) -> str:
    parts = [
        f"prompt {ledger.forecast_prompt_tokens:,} (cached {ledger.forecast_cached_tokens:,})",
    ]
    if ledger.forecast_completion_tokens is not None:
        parts.append(f"completion ~{ledger.forecast_completion_tokens:,}")
    if priced:
        parts.append(
            f"cost {money(ledger.forecast_cost_min)}-{money(ledger.forecast_cost_max)}"
            + (f", ~{money(ledger.forecast_cost)}" if ledger.forecast_cost is not None else "")
        )
    if ledger.forecast_seconds is not None:
        parts.append(f"~{ledger.forecast_seconds:,.1f} s")
    return "; ".join(parts)


def print_forecast(forecast) -> None:
    """A dry run's forecast as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    f = forecast
    priced = f.prices_set
    table = Table(title=f"forecast of job {f.job_id} (nothing computed)", show_header=False)
    rows = [
        ("model", f"{f.model} on {f.device}"),
        (
            "rows",
            f"{f.rows:,}: {f.rows_computed:,} to compute, {f.rows_deduplicated:,} duplicates "
            f"computed once, {f.rows_failed:,} failing before compute",
        ),
        (
            "shards",
            f"{f.shards:,}" + (f" ({f.shards_done:,} already complete)" if f.shards_done else ""),
        ),
        ("prompt tokens", f"{f.prompt_tokens:,} (exact)"),
        (
            "cached tokens",
            f"{f.cached_tokens:,} (exact: prefix cache of {f.cache_blocks:,} blocks of "
            f"{f.block_size} tokens)"
            if f.cached_tokens_exact
            else f"~{f.cached_tokens:,} (between {f.cached_tokens_min:,} and "
            f"{f.cached_tokens_max:,}: the cache of {f.cache_blocks:,} blocks may evict)",
        ),
        (
            "completion tokens",
            (
                f"~{f.completion_tokens_estimate:,}, "
                if f.completion_tokens_estimate is not None
                else ""
            )
            + f"between {f.completion_tokens_min:,} and {f.completion_tokens_max:,} (the budget)",
        ),
        (
            "cost (tokens)",
            NO_PRICES
            if not priced
            else (f"~{money(f.cost_estimate)}, " if f.cost_estimate is not None else "")
            + f"between {money(f.cost_min)} and {money(f.cost_max)}",
        ),
    ]
    if f.memory is not None:
        rows.append(("memory", f.memory.describe()))
        if f.memory.kv_cache_blocks:
            rows.append(("rows at once", f.memory.describe_rows(f.longest_row_tokens)))
    if f.seconds_estimate is not None:
        rows.append(("compute time", f"~{f.seconds_estimate:,.1f} s on {f.device}"))
    if f.device_cost_estimate is not None:
        rows.append(("cost (device time)", f"~{money(f.device_cost_estimate)}"))
    if f.calibration_rows_sampled is not None:
        rows.append(
            (
                "calibration",
                f"{f.calibration_rows:,} of {f.calibration_rows_sampled:,} sampled rows run in "
                f"{f.calibration_seconds:,.1f} s",
            )
        )
    else:
        rows.append(("calibration", "none (--no-calibrate): exact and bounded figures only"))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


@click.command("run")
@click.argument("input_uri", metavar="INPUT")
@click.argument("output_uri", metavar="OUTPUT")
@job_options(CLI)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the ledger (with --dry-run: the forecast) as JSON instead of a table; "
    "nothing else is printed.",
)
@click.pass_context
def run(ctx: click.Context, input_uri: str, output_uri: str, as_json: bool, **_: object) -> None:
    """Answer (or, with --task score, score; with --task embed, classify or rerank, pool)
    every row of INPUT and write results and a cost ledger to OUTPUT."""
    show = ctx.params["progress"] and not as_json
    from tokenmill.cli.progress import TerminalProgress
    from tokenmill.connectors import DiskFullError
    from tokenmill.pipelines.job import run_job

    progress = TerminalProgress(enabled=show, started=tokenmill.cli.STARTED)
    try:
        result = run_job(input_uri, output_uri, progress=progress, **given_options(ctx))
    except (ValueError, RuntimeError, FileNotFoundError, DiskFullError) as exc:
        # Input and option problems are reported, not traced back (SourceError is a ValueError).
        raise click.ClickException(str(exc)) from None
    finally:
        progress.close()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    elif ctx.params["dry_run"]:
        print_forecast(result)
    else:
        print_summary(result, output_uri)
