from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from tokenmill.pipelines.ledger import (
    LEDGER_SCHEMA,
    JobLedger,
    ShardStats,
    compute_ledger,
    percentile,
    token_sums,
)
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.results import RESULT_SCHEMA


def _results():
    return pa.Table.from_pylist(
        [
            {
                "id": "a",
                "output": "x",
                "finish_reason": "stop",
                "prompt_tokens": 100,
                "cached_tokens": 0,
                "completion_tokens": 10,
                "error": None,
            },
            {
                "id": "b",
                "output": "y",
                "finish_reason": "length",
                "prompt_tokens": 120,
                "cached_tokens": 96,
                "completion_tokens": 16,
                "error": None,
            },
            {
                "id": "c",
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


def _stats():
    return [
        ShardStats(
            "s0",
            2,
            "cpu",
            1.5,
            "2026-01-01T00:00:00+00:00",
            "2026-01-01T00:00:01+00:00",
            [0.5, 1.0],
        ),
        ShardStats(
            "s1", 1, "cpu", 0.5, "2026-01-01T00:00:02+00:00", "2026-01-01T00:00:03+00:00", [0.25]
        ),
    ]


def _ledger(results=None, **kw):
    args = dict(
        prices=Prices(
            input_per_1m=1.0, cached_input_per_1m=0.5, output_per_1m=4.0, device_per_hour=36.0
        ),
        job_id="j",
        run_id="r",
        model="m",
        weights_hash="w",
        engine_version="0.1.0",
        input_uri="s3://user:secret@bucket/in.parquet?sig=abc",
        output_uri="out",
        started_at="t0",
        finished_at="t1",
        num_shards=2,
        num_shards_run=1,
        quantization=None,
    )
    args.update(kw)
    return compute_ledger(_results() if results is None else results, _stats(), **args)


def test_token_sums_equal_result_rows():
    led = _ledger()
    t = _results()
    assert led.prompt_tokens == sum(t["prompt_tokens"].to_pylist()) == 220
    assert led.cached_tokens == 96 and led.completion_tokens == 26
    assert (led.rows_ok, led.rows_failed) == (2, 1)
    assert token_sums(t) == {
        "rows_ok": 2,
        "rows_failed": 1,
        "prompt_tokens": 220,
        "cached_tokens": 96,
        "completion_tokens": 26,
        "rows_deduplicated": 0,
        "image_tokens": 0,  # a job without images has no image_tokens column
        "reasoning_tokens": 0,  # nor one whose chat split no reasoning
    }


def test_reasoning_tokens_sum_the_rows_column():
    t = _results()
    t = t.append_column("reasoning_tokens", pa.array([7, 0, 0], pa.int64()))
    led = _ledger(t)
    assert led.reasoning_tokens == sum(t["reasoning_tokens"].to_pylist()) == 7
    assert led.completion_tokens == 26  # the reasoning is inside the completion, not beside
    assert token_sums(t)["reasoning_tokens"] == 7
    assert JobLedger.from_dict(led.to_dict()).reasoning_tokens == 7
    assert led.to_arrow()["reasoning_tokens"].to_pylist() == [7]


def test_costs_timings_and_rates():
    led = _ledger()
    assert led.cost_input == 0.000124  # 124 uncached x $1/1M
    assert led.cost_cached_input == 0.000048
    assert led.cost_output == 0.000104
    assert led.cost_total == 0.000276
    assert led.cost_per_1k_requests == 0.138
    assert led.device_seconds == 2.0 and led.device == "cpu"
    assert led.cost_device == 0.02  # 2 s at $36/h
    assert led.throughput_tokens_per_s == 123.0  # 246 tokens / 2 s
    assert led.output_tokens_per_s == 13.0
    assert led.prefix_cache_hit_rate == 96 / 220
    assert led.latency_p50_s == 0.5
    assert led.latency_p99_s == pytest.approx(np.percentile([0.25, 0.5, 1.0], 99))


def test_credentials_never_reach_the_ledger():
    led = _ledger()
    text = json.dumps(led.to_dict())
    assert "secret" not in text and "sig=abc" not in text
    assert led.input_uri.startswith("s3://") and "bucket/in.parquet" in led.input_uri


def test_one_row_with_fixed_schema_round_trips():
    led = _ledger(prices=Prices())  # no device price -> null device costs
    table = led.to_arrow()
    assert table.schema == LEDGER_SCHEMA and table.num_rows == 1
    assert table["cost_device"].type == pa.float64()
    assert JobLedger.from_dict(table.to_pylist()[0]) == led
    assert JobLedger.from_dict(json.loads(json.dumps(led.to_dict()))) == led


@pytest.mark.parametrize("q", [0, 1, 50, 95, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.3, 0.1, 2.5, 0.7, 1.1, 0.9, 4.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([2.0], 99) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_no_device_time_gives_no_rates():
    led = compute_ledger(
        _results(),
        [],
        prices=Prices(),
        job_id="j",
        run_id="r",
        model="m",
        weights_hash="w",
        engine_version="v",
        input_uri="i",
        output_uri="o",
        started_at="a",
        finished_at="b",
        num_shards=0,
        num_shards_run=0,
        quantization=None,
    )
    assert led.throughput_tokens_per_s is None and led.latency_p50_s is None


def test_a_ledger_dataset_written_before_tasks_reads_as_generation_jobs(tmp_path):
    """The `task` column joined the ledger later: a dataset holding rows from before it
    (no such column) and after it reads as one table, the old rows as generation jobs;
    an old ledger.json reads the same way."""
    import pyarrow.parquet as pq

    from tokenmill.pipelines.output import read_ledger_dataset, write_ledger

    old = _ledger(job_id="old", started_at="2026-01-01T00:00:00").to_arrow().drop_columns(["task"])
    dataset = tmp_path / "ledger"
    dataset.mkdir()
    pq.write_table(old, dataset / "job-old.parquet")
    assert read_ledger_dataset(str(dataset))["task"].to_pylist() == ["generate"]
    new = _ledger(job_id="new", started_at="2026-02-01T00:00:00", task="score")
    write_ledger(new, str(tmp_path / "out"), ledger_dataset=str(dataset))
    table = read_ledger_dataset(str(dataset))
    assert table["job_id"].to_pylist() == ["old", "new"]
    assert table["task"].to_pylist() == ["generate", "score"]
    assert table["prompt_tokens"].to_pylist() == [220, 220]
    raw = new.to_dict()
    del raw["task"]
    assert JobLedger.from_dict(raw).task == "generate"


def test_records_read_add_up_to_the_rows_and_the_blanks():
    led = _ledger(rows_skipped_blank=4)
    assert (led.rows_ok, led.rows_failed, led.rows_skipped_blank) == (2, 1, 4)
    assert led.rows_read == 7
    assert JobLedger.from_dict(led.to_arrow().to_pylist()[0]) == led
    # A ledger from before records were counted says so (None), rather than 0 read.
    raw = led.to_dict()
    del raw["rows_read"], raw["rows_skipped_blank"]
    assert (JobLedger.from_dict(raw).rows_read, _ledger().rows_skipped_blank) == (None, None)
