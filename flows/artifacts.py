"""A job's ledger as Prefect artifacts: a table of its figures and a markdown summary.

Both are built from the `JobLedger` that was written to `OUTPUT/ledger.json`, never
recomputed, so the figures in the Prefect UI are the ledger's figures exactly. The
artifacts' keys are stable per job (`tokenmill-ledger-<job id>`), so a rerun of the
same job adds a new version of the same artifact rather than a new one.
"""

from __future__ import annotations

from tokenmill.pipelines.ledger import JobLedger

# (ledger field, unit): the cost and token figures, in the order the table shows them.
TABLE_FIGURES: tuple[tuple[str, str], ...] = (
    ("rows_ok", "rows"),
    ("rows_failed", "rows"),
    ("prompt_tokens", "tokens"),
    ("cached_tokens", "tokens"),
    ("completion_tokens", "tokens"),
    ("price_input_per_1m", "USD / 1M tokens"),
    ("price_cached_input_per_1m", "USD / 1M tokens"),
    ("price_output_per_1m", "USD / 1M tokens"),
    ("price_device_per_hour", "USD / device-hour"),
    ("cost_input", "USD"),
    ("cost_cached_input", "USD"),
    ("cost_output", "USD"),
    ("cost_total", "USD"),
    ("cost_per_1k_requests", "USD"),
    ("cost_per_1m_tokens", "USD"),
    ("cost_device", "USD"),
    ("device_cost_per_1k_requests", "USD"),
    ("device_cost_per_1m_tokens", "USD"),
    ("device_seconds", "s"),
    ("throughput_tokens_per_s", "tokens / s"),
    ("output_tokens_per_s", "tokens / s"),
    ("prefix_cache_hit_rate", "fraction"),
    ("latency_p50_s", "s"),
    ("latency_p95_s", "s"),
    ("latency_p99_s", "s"),
)


def artifact_key(kind: str, job_id: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only)."""
    return f"tokenmill-{kind}-{job_id}".lower()


def ledger_table(ledger: JobLedger) -> list[dict]:
    """The table artifact's rows: one per figure, with its exact ledger value."""
    values = ledger.to_dict()
    return [{"figure": name, "value": values[name], "unit": unit} for name, unit in TABLE_FIGURES]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def ledger_markdown(ledger: JobLedger, *, results_uri: str, ledger_uri: str) -> str:
    """A short human summary of the job (counts and money only - no prompts, no outputs)."""
    skipped = ledger.num_shards - ledger.num_shards_run
    return "\n".join(
        [
            f"# tokenmill job `{ledger.job_id}`",
            "",
            f"- **task**: {ledger.task}",
            f"- **model**: `{ledger.model}` (weights `{ledger.weights_hash[:12]}`), "
            f"engine {ledger.engine_version}, device `{ledger.device or 'n/a'}`",
            f"- **input**: `{ledger.input_uri}`",
            f"- **results**: `{results_uri}`",
            f"- **ledger**: `{ledger_uri}`",
            f"- **rows**: {ledger.rows_ok} ok, {ledger.rows_failed} failed",
            f"- **shards**: {ledger.num_shards} ({ledger.num_shards_run} computed by this run, "
            f"{skipped} already complete)",
            f"- **tokens**: {ledger.prompt_tokens} prompt ({ledger.cached_tokens} cached), "
            f"{ledger.completion_tokens} completion",
            f"- **cost**: {ledger.cost_total:.6f} USD "
            f"(input {ledger.cost_input:.6f}, cached input {ledger.cost_cached_input:.6f}, "
            f"output {ledger.cost_output:.6f})",
            f"- **throughput**: {_fmt(ledger.throughput_tokens_per_s, '.1f')} tokens/s over "
            f"{ledger.device_seconds:.2f} device-seconds; "
            f"prefix cache hit rate {ledger.prefix_cache_hit_rate:.1%}",
            f"- **latency**: p50 {_fmt(ledger.latency_p50_s, '.3f')} s, "
            f"p95 {_fmt(ledger.latency_p95_s, '.3f')} s, "
            f"p99 {_fmt(ledger.latency_p99_s, '.3f')} s",
            f"- **run**: {ledger.started_at} -> {ledger.finished_at}",
            "",
        ]
    )


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
