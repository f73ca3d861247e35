"""The ledger's artifacts hold the ledger's own figures, and no prompt or output text."""

from __future__ import annotations

import pyarrow as pa

from tokenmill.flows.artifacts import (
    TABLE_FIGURES,
    artifact_key,
    ledger_markdown,
    ledger_table,
)
from tokenmill.pipelines.ledger import ShardStats, compute_ledger
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.results import RESULT_SCHEMA


def make_ledger():
    results = pa.Table.from_pylist(
        [
            {
                "id": "a",
                "output": "SECRET ANSWER",
                "finish_reason": "stop",
                "prompt_tokens": 10,
                "cached_tokens": 4,
                "completion_tokens": 5,
                "error": None,
            },
            {
                "id": "b",
                "output": None,
                "finish_reason": "error",
                "prompt_tokens": 0,
                "cached_tokens": 0,
                "completion_tokens": 0,
                "error": "prompt is null",
            },
        ],
        schema=RESULT_SCHEMA,
    )
    stats = [
        ShardStats("s0", 2, "cpu", 1.5, "2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z", [0.5, 1.0])
    ]
    return compute_ledger(
        results,
        stats,
        prices=Prices(1.0, 0.5, 2.0, device_per_hour=3.6),
        job_id="ABC123",
        run_id="r",
        model="tiny",
        weights_hash="f" * 64,
        engine_version="0.1.0",
        input_uri="s3://u:pw@b/in?sig=1",
        output_uri="s3://b/out",
        started_at="t0",
        finished_at="t1",
        num_shards=3,
        num_shards_run=1,
    )


def test_table_rows_are_the_ledger_figures_exactly():
    ledger = make_ledger()
    table = ledger_table(ledger)
    assert [row["figure"] for row in table] == [name for name, _ in TABLE_FIGURES]
    for row in table:
        assert row["value"] == getattr(ledger, row["figure"])
    by_name = {row["figure"]: row["value"] for row in table}
    assert by_name["prompt_tokens"] == 10 and by_name["cached_tokens"] == 4
    assert by_name["rows_ok"] == 1 and by_name["rows_failed"] == 1
    assert by_name["cost_total"] == ledger.cost_total == 0.000018


def test_markdown_summarises_counts_and_money_only():
    ledger = make_ledger()
    text = ledger_markdown(ledger, results_uri="s3://b/out/results", ledger_uri="s3://b/out/l")
    assert "ABC123" in text and "1 ok, 1 failed" in text
    assert "3 (1 computed by this run, 2 already complete)" in text
    assert f"{ledger.cost_total:.6f} USD" in text
    assert "SECRET ANSWER" not in text and "prompt is null" not in text
    assert "pw" not in text and "sig=1" not in text  # the ledger's URIs are redacted


def test_keys_are_valid_prefect_artifact_keys():
    assert artifact_key("ledger", "ABC123") == "tokenmill-ledger-abc123"
