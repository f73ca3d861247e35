"""A job's ledger and progress as Prefect artifacts: a report table, a markdown summary,
and a progress bar with the figures a person watches.

The ledger artifacts are built from the `JobLedger` that was written to
`OUTPUT/ledger.json`, never recomputed: they show its figures rounded for reading
(`pipelines/report.py`: separators, "$0.0123", "not set" for a price never given, "no
prices set" for costs then), with the forecast beside them when the job had a dry run;
`ledger.json` keeps the exact values. The artifacts' keys are stable per job
(`tokenmill-ledger-<job id>`), so a rerun of the same job adds a new version of the
same artifact rather than a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from tokenmill.pipelines import report
from tokenmill.pipelines.forecast import Forecast
from tokenmill.pipelines.ledger import JobLedger
from tokenmill.pipelines.progress import Snapshot

_PER_1M = "USD / 1M tokens"


def _usd(ledger: JobLedger, value: float | None) -> str:
    return report.money(value) if report.prices_given(ledger) else report.NO_PRICES


# (label, ledger field, how it reads, the forecast field beside it or None)
Figure = tuple[str, str, Callable[[JobLedger, Any], str], str | None]
TABLE_FIGURES: tuple[Figure, ...] = (
    ("model", "model", lambda ledger, v: f"{v} ({ledger.weights_hash[:12]})", None),
    ("device", "device", lambda _, v: v or report.NOT_APPLICABLE, None),
    ("input", "input_uri", lambda _, v: v, None),
    ("task", "task", lambda _, v: v, None),
    ("rows ok", "rows_ok", lambda _, v: report.count(v), None),
    ("rows failed", "rows_failed", lambda _, v: report.count(v), None),
    ("rows deduplicated", "rows_deduplicated", lambda _, v: report.count(v), None),
    ("records read", "rows_read", lambda _, v: report.count(v), None),
    ("blank records skipped", "rows_skipped_blank", lambda _, v: report.count(v), None),
    ("prompt tokens", "prompt_tokens", lambda _, v: report.count(v), "forecast_prompt_tokens"),
    ("cached tokens", "cached_tokens", lambda _, v: report.count(v), "forecast_cached_tokens"),
    (
        "completion tokens",
        "completion_tokens",
        lambda _, v: report.count(v),
        "forecast_completion_tokens",
    ),
    ("price input", "price_input_per_1m", lambda _, v: report.price(v, _PER_1M), None),
    (
        "price cached input",
        "price_cached_input_per_1m",
        lambda _, v: report.price(v, _PER_1M),
        None,
    ),
    ("price output", "price_output_per_1m", lambda _, v: report.price(v, _PER_1M), None),
    (
        "price device",
        "price_device_per_hour",
        lambda _, v: report.price(v, "USD / device-hour"),
        None,
    ),
    ("cost input", "cost_input", _usd, None),
    ("cost cached input", "cost_cached_input", _usd, None),
    ("cost output", "cost_output", _usd, None),
    ("cost total", "cost_total", _usd, "forecast_cost"),
    ("cost per 1K requests", "cost_per_1k_requests", _usd, None),
    ("cost per 1M tokens", "cost_per_1m_tokens", _usd, None),
    (
        "cost device time",
        "cost_device",
        lambda ledger, v: report.money(v) if v is not None else report.NOT_SET,
        None,
    ),
    ("device seconds", "device_seconds", lambda _, v: report.seconds(v), "forecast_seconds"),
    ("throughput", "throughput_tokens_per_s", lambda _, v: report.rate(v), None),
    ("output throughput", "output_tokens_per_s", lambda _, v: report.rate(v), None),
    ("prefix cache hit rate", "prefix_cache_hit_rate", lambda _, v: report.percent(v), None),
    ("latency p50", "latency_p50_s", lambda _, v: report.seconds(v), None),
    ("latency p95", "latency_p95_s", lambda _, v: report.seconds(v), None),
    ("latency p99", "latency_p99_s", lambda _, v: report.seconds(v), None),
)


def artifact_key(kind: str, job_id: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only)."""
    return f"tokenmill-{kind}-{job_id}".lower()


def ledger_table(ledger: JobLedger) -> list[dict[str, str]]:
    """The table artifact's rows: each figure as it reads, and its forecast when the job
    was forecast ("-" where the forecast has no such figure)."""
    forecast = ledger.forecast_prompt_tokens is not None
    rows = []
    for label, name, show, forecast_name in TABLE_FIGURES:
        row = {"figure": label, "value": show(ledger, getattr(ledger, name))}
        if forecast:
            value = getattr(ledger, forecast_name) if forecast_name else None
            row["forecast"] = "-" if value is None else _forecast_cell(ledger, name, value)
        rows.append(row)
    return rows


def _forecast_cell(ledger: JobLedger, name: str, value: Any) -> str:
    if name == "cost_total":
        if not report.prices_given(ledger):
            return report.NO_PRICES
        low, high = ledger.forecast_cost_min, ledger.forecast_cost_max
        return f"{report.money(value)} ({report.money(low)} - {report.money(high)})"
    if name == "device_seconds":
        return report.seconds(value)
    return report.count(value)


def ledger_markdown(ledger: JobLedger, *, results_uri: str, ledger_uri: str) -> str:
    """A short human summary of the job (counts and money only - no prompts, no outputs)."""
    skipped = ledger.num_shards - ledger.num_shards_run
    priced = report.prices_given(ledger)
    cost = (
        f"{report.money(ledger.cost_total)} (input {report.money(ledger.cost_input)}, "
        f"cached input {report.money(ledger.cost_cached_input)}, "
        f"output {report.money(ledger.cost_output)})"
        if priced
        else report.NO_PRICES
    )
    deduplicated = (
        f", {ledger.rows_deduplicated:,} duplicates computed once"
        if ledger.rows_deduplicated
        else ""
    )
    lines = [
        f"# tokenmill job `{ledger.job_id}`",
        "",
        f"- **task**: {ledger.task}",
        f"- **model**: `{ledger.model}` (weights `{ledger.weights_hash[:12]}`), "
        f"engine {ledger.engine_version}, device `{ledger.device or 'n/a'}`",
        f"- **input**: `{ledger.input_uri}`",
        f"- **results**: `{results_uri}`",
        f"- **ledger**: `{ledger_uri}`",
        f"- **rows**: {ledger.rows_ok:,} ok, {ledger.rows_failed:,} failed{deduplicated}"
        + (
            f"; {ledger.rows_read:,} records read ({ledger.rows_skipped_blank:,} blank)"
            if ledger.rows_read is not None
            else ""
        ),
        f"- **shards**: {ledger.num_shards:,} ({ledger.num_shards_run:,} computed by this "
        f"run, {skipped:,} already complete)",
        f"- **tokens**: {ledger.prompt_tokens:,} prompt ({ledger.cached_tokens:,} cached), "
        f"{ledger.completion_tokens:,} completion",
        f"- **cost**: {cost}",
        f"- **throughput**: {report.rate(ledger.throughput_tokens_per_s)} over "
        f"{report.seconds(ledger.device_seconds)} of device time; "
        f"prefix cache hit rate {report.percent(ledger.prefix_cache_hit_rate)}",
        f"- **latency**: p50 {report.seconds(ledger.latency_p50_s)}, "
        f"p95 {report.seconds(ledger.latency_p95_s)}, "
        f"p99 {report.seconds(ledger.latency_p99_s)}",
        f"- **run**: {ledger.started_at} -> {ledger.finished_at}",
    ]
    if ledger.forecast_prompt_tokens is not None:
        lines.append(
            f"- **forecast** (dry run): {ledger.forecast_prompt_tokens:,} prompt "
            f"({ledger.forecast_cached_tokens:,} cached)"
            + (
                f", ~{ledger.forecast_completion_tokens:,} completion"
                if ledger.forecast_completion_tokens is not None
                else ""
            )
            + (
                f", ~{report.seconds(ledger.forecast_seconds)}"
                if ledger.forecast_seconds is not None
                else ""
            )
        )
    return "\n".join([*lines, ""])


def publish_ledger(ledger: JobLedger, *, results_uri: str, ledger_uri: str) -> None:
    """Create the table and markdown artifacts of `ledger` in the current flow run.

    Args:
        ledger: the job's ledger, as written.
        results_uri, ledger_uri: where the results and `ledger.json` live (redacted).
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_table_artifact(
        table=ledger_table(ledger),
        key=artifact_key("ledger", ledger.job_id),
        description=f"Cost and token figures of tokenmill job {ledger.job_id}",
    )
    create_markdown_artifact(
        markdown=ledger_markdown(ledger, results_uri=results_uri, ledger_uri=ledger_uri),
        key=artifact_key("summary", ledger.job_id),
        description=f"Summary of tokenmill job {ledger.job_id}",
    )


def progress_text(snap: Snapshot) -> str:
    """What the progress artifact says beside its bar."""
    eta = "n/a" if snap.eta_s is None else f"{snap.eta_s:,.0f} s"
    text = (
        f"{snap.rows_done:,} of {snap.rows_total:,} rows, {snap.tokens_done:,} of "
        f"{snap.tokens_total:,} tokens ({snap.fraction:.0%}); "
        f"{report.rate(snap.tokens_per_s)}; ETA {eta}"
    )
    if snap.cost is not None:
        text += f"; cost so far {report.money(snap.cost)}"
    return text


class ProgressArtifact:
    """The flow run's progress artifact (`tokenmill-progress-<job id>`): created at the
    first update, then updated in place."""

    def __init__(self, job_id: str) -> None:
        self.key = artifact_key("progress", job_id)
        self.artifact_id: UUID | None = None

    def update(self, snap: Snapshot) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent = round(100 * snap.fraction, 1)
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                percent, key=self.key, description=progress_text(snap)
            )
        else:
            update_progress_artifact(self.artifact_id, percent, description=progress_text(snap))


def forecast_markdown(forecast: Forecast) -> str:
    """A dry run's forecast as a short markdown report."""
    f = forecast
    priced = f.prices_set
    cached = (
        f"{f.cached_tokens:,} (exact)"
        if f.cached_tokens_exact
        else f"~{f.cached_tokens:,} ({f.cached_tokens_min:,} - {f.cached_tokens_max:,})"
    )
    estimate = (
        f"~{f.completion_tokens_estimate:,}, " if f.completion_tokens_estimate is not None else ""
    )
    cost = report.NO_PRICES
    if priced:
        cost = f"{report.money(f.cost_min)} - {report.money(f.cost_max)}"
        if f.cost_estimate is not None:
            cost = f"~{report.money(f.cost_estimate)} ({cost})"
    lines = [
        f"# tokenmill forecast of job `{f.job_id}` (nothing computed)",
        "",
        f"- **model**: `{f.model}` on `{f.device}`",
        f"- **rows**: {f.rows:,} ({f.rows_computed:,} to compute, {f.rows_deduplicated:,} "
        f"duplicates computed once, {f.rows_failed:,} failing before compute)",
        f"- **prompt tokens**: {f.prompt_tokens:,} (exact)",
        f"- **cached tokens**: {cached}",
        f"- **completion tokens**: {estimate}{f.completion_tokens_min:,} - "
        f"{f.completion_tokens_max:,}",
        f"- **cost**: {cost}",
    ]
    if f.seconds_estimate is not None:
        lines.append(f"- **compute time**: ~{report.seconds(f.seconds_estimate)}")
    if f.calibration_rows_sampled is not None:
        lines.append(
            f"- **calibration**: {f.calibration_rows:,} of {f.calibration_rows_sampled:,} "
            f"sampled rows in {report.seconds(f.calibration_seconds)}"
        )
    return "\n".join([*lines, ""])


def publish_forecast(forecast: Forecast) -> None:
    """The forecast as a markdown artifact of the current flow run."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=forecast_markdown(forecast),
        key=artifact_key("forecast", forecast.job_id or "notebook"),
        description=f"Forecast of tokenmill job {forecast.job_id}",
    )


def publish_workers(job_id: str, rows: list[dict[str, Any]]) -> None:
    """Create the workers table artifact (`tokenmill-workers-<job id>`): per worker,
    the shards it computed in this flow run and the engine loads they paid."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        table=rows,
        key=artifact_key("workers", job_id),
        description=f"Where the shards of tokenmill job {job_id} ran, and engine loads",
    )
