"""`tokenmill run INPUT OUTPUT`: a batch job from the command line, with a progress bar.

Results go to OUTPUT/results/ (one part per shard), the ledger to OUTPUT/ledger.json
and to the ledger dataset (`--ledger-dataset`, env TOKENMILL_LEDGER_DATASET, default
OUTPUT/ledger/). Rerunning the same command resumes a killed job.
"""

from __future__ import annotations

import json
import time

import click

from tokenmill.cli.options import given_options, job_options
from tokenmill.pipelines.option_types import CLI


def _progress_class():
    # Imported when the command runs: the pipelines pull in pyarrow and the engine.
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from tokenmill.pipelines.job import JobProgress

    class RichProgress(JobProgress):
        """Rows done, tokens/s, prefix-cache hit rate and ETA, on stderr."""

        def __init__(self, *, enabled: bool) -> None:
            self.console = Console(stderr=True)
            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} rows"),
                TextColumn("{task.fields[rate]:>8.0f} tok/s"),
                TextColumn("cache hit {task.fields[hit]:>4.0%}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                disable=not enabled,
            )
            self.task = None
            self.rows_in_done_shards = 0
            self.requests_in_shard = 0
            self.tokens = self.prompt_tokens = self.cached_tokens = 0
            self.started = time.perf_counter()

        def planned(self, plan, pending) -> None:
            total = sum(s.num_rows for s in pending)
            skipped = len(plan.shards) - len(pending)
            if skipped:
                self.console.print(f"resuming: {skipped} of {len(plan.shards)} shards already done")
            self.bar.start()
            label = {"score": "scoring", "embed": "embedding", "classify": "classifying"}.get(
                plan.spec.task, "reranking" if plan.spec.task == "rerank" else "generating"
            )
            self.task = self.bar.add_task(label, total=total, rate=0.0, hit=0.0)
            self.started = time.perf_counter()

        def request_done(self, output) -> None:
            self.requests_in_shard += 1
            self.tokens += output.prompt_tokens + output.completion_tokens
            self.prompt_tokens += output.prompt_tokens
            self.cached_tokens += output.cached_tokens
            self._update()

        def shard_done(self, result) -> None:
            self.rows_in_done_shards += result.num_rows
            self.requests_in_shard = 0
            self._update()

        def _update(self) -> None:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.update(
                self.task,
                completed=self.rows_in_done_shards + self.requests_in_shard,
                rate=self.tokens / elapsed,
                hit=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            )

        def close(self) -> None:
            self.bar.stop()

    return RichProgress


def print_summary(ledger, output: str) -> None:
    """The ledger's headline figures as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value, spec=",", unit=""):
        return "-" if value is None else f"{value:{spec}}{unit}"

    table = Table(title=f"job {ledger.job_id}", show_header=False)
    rows = [
        ("task", ledger.task),
        ("model", f"{ledger.model} ({ledger.weights_hash[:12]})"),
        ("rows", f"{ledger.rows_ok:,} ok, {ledger.rows_failed:,} failed"),
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
        (
            "cost (tokens)",
            f"${ledger.cost_total:.6f} = input ${ledger.cost_input:.6f} + cached "
            f"${ledger.cost_cached_input:.6f} + output ${ledger.cost_output:.6f}",
        ),
        (
            "cost per 1K requests / 1M tokens",
            f"{fmt(ledger.cost_per_1k_requests, '.6f')} / {fmt(ledger.cost_per_1m_tokens, '.6f')} USD",
        ),
    ]
    if ledger.cost_device is not None:
        rows.append(("cost (device time)", f"${ledger.cost_device:.6f}"))
    rows.append(
        ("results", f"{output.rstrip('/')}/results/  ledger: {output.rstrip('/')}/ledger.json")
    )
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


@click.command("run")
@click.argument("input_uri", metavar="INPUT")
@click.argument("output_uri", metavar="OUTPUT")
@job_options(CLI)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the ledger as JSON instead of a summary table."
)
@click.pass_context
def run(ctx: click.Context, input_uri: str, output_uri: str, as_json: bool, **_: object) -> None:
    """Answer (or, with --task score, score; with --task embed, classify or rerank, pool)
    every row of INPUT and write results and a cost ledger to OUTPUT."""
    from tokenmill.connectors import DiskFullError
    from tokenmill.pipelines.job import run_job

    progress = _progress_class()(enabled=ctx.params["progress"])
    try:
        ledger = run_job(input_uri, output_uri, progress=progress, **given_options(ctx))
    except (ValueError, RuntimeError, FileNotFoundError, DiskFullError) as exc:
        # Input and option problems are reported, not traced back (SourceError is a ValueError).
        raise click.ClickException(str(exc)) from None
    finally:
        progress.close()
    if as_json:
        click.echo(json.dumps(ledger.to_dict(), indent=2))
    else:
        print_summary(ledger, output_uri)
