"""The ledger's artifacts read as a report of the ledger's own figures (rounded, with
separators, "not set" for a price never given), and hold no prompt or output text."""

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
        quantization=None,
    )


def test_table_reads_as_a_report_of_the_ledger():
    ledger = make_ledger()
    table = ledger_table(ledger)
    assert [row["figure"] for row in table] == [label for label, *_ in TABLE_FIGURES]
    by_name = {row["figure"]: row["value"] for row in table}
    assert by_name["model"] == f"tiny ({'f' * 12})" and by_name["device"] == "cpu"
    assert by_name["input"] == ledger.input_uri and "pw" not in by_name["input"]
    assert by_name["prompt tokens"] == "10" and by_name["cached tokens"] == "4"
    assert by_name["rows ok"] == "1" and by_name["rows failed"] == "1"
    assert ledger.cost_total == 0.000018 and by_name["cost total"] == "$0.0000180"
    assert by_name["price input"] == "$1 USD / 1M tokens"
    assert by_name["price device"] == "$3.6 USD / device-hour"
    assert by_name["prefix cache hit rate"] == "40.0%"
    assert by_name["device seconds"] == "1.50 s"
    assert all("forecast" not in row for row in table)  # the job had no dry run


def test_prices_not_given_read_not_set():
    ledger = make_ledger()
    for name in ("price_input_per_1m", "price_cached_input_per_1m", "price_output_per_1m"):
        setattr(ledger, name, None)
    ledger.price_device_per_hour = ledger.cost_device = None
    by_name = {row["figure"]: row["value"] for row in ledger_table(ledger)}
    assert by_name["price input"] == by_name["price output"] == "not set"
    assert by_name["price device"] == by_name["cost device time"] == "not set"
    assert by_name["cost total"] == "no prices set"
    text = ledger_markdown(ledger, results_uri="r", ledger_uri="l")
    assert "**cost**: no prices set" in text and "0.000000" not in text


def test_the_forecast_stands_beside_the_actuals():
    ledger = make_ledger()
    ledger.forecast_prompt_tokens, ledger.forecast_cached_tokens = 10, 4
    ledger.forecast_completion_tokens, ledger.forecast_seconds = 6, 1.25
    ledger.forecast_cost, ledger.forecast_cost_min, ledger.forecast_cost_max = 2e-5, 1e-5, 3e-5
    rows = {row["figure"]: row for row in ledger_table(ledger)}
    assert rows["prompt tokens"]["forecast"] == "10"
    assert rows["completion tokens"] == {
        "figure": "completion tokens",
        "value": "5",
        "forecast": "6",
    }
    assert rows["cost total"]["forecast"] == "$0.0000200 ($0.0000100 - $0.0000300)"
    assert rows["device seconds"]["forecast"] == "1.25 s" and rows["model"]["forecast"] == "-"


def test_markdown_summarises_counts_and_money_only():
    ledger = make_ledger()
    text = ledger_markdown(ledger, results_uri="s3://b/out/results", ledger_uri="s3://b/out/l")
    assert "ABC123" in text and "1 ok, 1 failed" in text
    assert "3 (1 computed by this run, 2 already complete)" in text
    assert "**cost**: $0.0000180 (input $0.00000600" in text
    assert "SECRET ANSWER" not in text and "prompt is null" not in text
    assert "pw" not in text and "sig=1" not in text  # the ledger's URIs are redacted


def test_keys_are_valid_prefect_artifact_keys():
    assert artifact_key("ledger", "ABC123") == "tokenmill-ledger-abc123"
