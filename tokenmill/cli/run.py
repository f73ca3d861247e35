"""`tokenmill run INPUT OUTPUT`: a batch job from the command line, with a progress bar.

Results go to OUTPUT/results/ (one part per shard), the ledger to OUTPUT/ledger.json
and to the ledger dataset (`--ledger-dataset`, env TOKENMILL_LEDGER_DATASET, default
OUTPUT/ledger/). Rerunning the same command resumes a killed job.
"""

from __future__ import annotations

import json
import time

import click


def parse_storage_options(pairs: tuple[str, ...], *, flag: str = "--storage-option") -> dict:
    """`KEY=VALUE` pairs as a dict; JSON values (true, 3, {...}) are decoded."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # the argument may be a secret: do not echo it
            raise ValueError(f"{flag} must be KEY=VALUE (got one without '=')")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


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
            self.task = self.bar.add_task("generating", total=total, rate=0.0, hit=0.0)
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
            + f" ({fmt(ledger.output_tokens_per_s, ',.0f', ' output tok/s')})",
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
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file or alias (default: smollm2-135m-instruct).",
)
@click.option(
    "--format",
    "input_format",
    default=None,
    help="Input format: parquet, jsonl, csv, openai-batch (default: from file names).",
)
@click.option(
    "--prompt-column", default="prompt", show_default=True, help="Column holding the prompt text."
)
@click.option(
    "--messages-column",
    default=None,
    help="Column holding chat messages (list of {role, content}).",
)
@click.option(
    "--template", default=None, help='Prompt template over columns, e.g. "Summarise: {text}".'
)
@click.option("--system", default=None, help="System prompt for every row (implies --chat).")
@click.option(
    "--chat/--raw",
    default=False,
    show_default=True,
    help="Wrap prompt/template text in the model's chat template.",
)
@click.option(
    "--id-column",
    default=None,
    help="Column of unique row ids (default: ids from row position, row-000000000...).",
)
@click.option(
    "--passthrough",
    multiple=True,
    metavar="COL",
    help="Input column to copy into the results (repeatable).",
)
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="0 = greedy (reproducible reruns).",
)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Per-request sampling seed.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--shard-tokens",
    type=int,
    default=None,
    help="Token budget of one shard, the unit of resume (default 131072).",
)
@click.option(
    "--plan-window-rows",
    type=click.IntRange(min=1),
    default=None,
    help="Input rows ordered and cut into shards together; planning memory grows "
    "with this, not with the input (default 32768).",
)
@click.option(
    "--storage-option",
    "storage_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option for input, output and ledger (repeatable).",
)
@click.option(
    "--price-input",
    type=float,
    default=0.0,
    show_default=True,
    help="USD per 1M uncached prompt tokens.",
)
@click.option(
    "--price-cached",
    type=float,
    default=None,
    help="USD per 1M cached prompt tokens (default: the input price).",
)
@click.option(
    "--price-output",
    type=float,
    default=0.0,
    show_default=True,
    help="USD per 1M completion tokens.",
)
@click.option(
    "--price-device-hour",
    type=float,
    default=None,
    help="USD per device-hour, for device-time cost.",
)
@click.option("--limit", type=int, default=None, help="Only the first N input rows.")
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Skip shards already complete; --no-resume recomputes everything.",
)
@click.option(
    "--output-format",
    type=click.Choice(["parquet", "jsonl", "openai-batch"]),
    default="parquet",
    show_default=True,
)
@click.option(
    "--ledger-dataset",
    envvar="TOKENMILL_LEDGER_DATASET",
    default=None,
    help="Ledger dataset URL (env TOKENMILL_LEDGER_DATASET; default OUTPUT/ledger/).",
)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA when available).")
@click.option(
    "--engine-option",
    "engine_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="LLM engine option, e.g. kv_cache_memory=268435456 or max_num_seqs=128 (repeatable).",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the ledger as JSON instead of a summary table."
)
def run(input_uri, output_uri, **opts) -> None:
    """Answer every row of INPUT and write results and a cost ledger to OUTPUT."""
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.pricing import Prices

    as_json, show_progress = opts.pop("as_json"), opts.pop("progress")
    try:
        sampling = SamplingParams(
            max_tokens=opts.pop("max_tokens"),
            temperature=opts.pop("temperature"),
            top_p=opts.pop("top_p"),
            top_k=opts.pop("top_k"),
            min_p=opts.pop("min_p"),
            seed=opts.pop("seed"),
            stop=list(opts.pop("stop")),
        )
        prices = Prices(
            input_per_1m=opts.pop("price_input"),
            cached_input_per_1m=opts.pop("price_cached"),
            output_per_1m=opts.pop("price_output"),
            device_per_hour=opts.pop("price_device_hour"),
        )
        storage_options = parse_storage_options(opts.pop("storage_option"))
        engine_options = parse_storage_options(opts.pop("engine_option"), flag="--engine-option")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    extra = {k: opts.pop(k) for k in ("shard_tokens", "plan_window_rows")}
    extra = {k: v for k, v in extra.items() if v is not None}
    progress = _progress_class()(enabled=show_progress)
    try:
        ledger = run_job(
            input_uri,
            output_uri,
            progress=progress,
            sampling=sampling,
            prices=prices,
            storage_options=storage_options or None,
            engine_options=engine_options,
            format=opts.pop("input_format"),
            passthrough=tuple(opts.pop("passthrough")),
            **opts,
            **extra,
        )
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        # Input and option problems are reported, not traced back (SourceError is a ValueError).
        raise click.ClickException(str(exc)) from None
    finally:
        progress.close()
    if as_json:
        click.echo(json.dumps(ledger.to_dict(), indent=2))
    else:
        print_summary(ledger, output_uri)
