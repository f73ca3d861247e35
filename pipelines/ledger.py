"""The per-job ledger: what ran, on what, and exactly what it cost.

Pure functions. The token sums are computed from the result rows themselves (read back
from the written parts), never from counters kept while running, so they equal the
sums over the rows - including after a resume. Timing figures (device-seconds,
latencies) come from the per-shard stats saved next to each part, so a resumed job
still reports the time its earlier runs spent.

A job with LoRA adapters also splits its rows, tokens and token costs per adapter
(`JobLedger.adapters`: the base model's rows first, then each adapter's, every one
listed even with no rows), summed from the results' `adapter` column - so the split
adds up to the job's totals.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tokenmill.connectors.fs import redact_url
from tokenmill.pipelines.pricing import Prices, token_costs
from tokenmill.pipelines.scoring import GENERATE


def now_iso() -> str:
    """The current time as the ledger writes times: ISO 8601, UTC, milliseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class ShardStats:
    """Timings of one finished shard, saved beside its part."""

    shard_id: str
    num_rows: int
    device: str
    device_seconds: float  # wall time of the shard's generate call
    started_at: str  # ISO 8601, UTC
    finished_at: str
    latencies: list[float] = field(default_factory=list)  # seconds, one per served request
    # Row and token counts of the part, so progress can be read from the stats alone
    # while a job runs (the ledger itself is summed from the parts' rows).
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_rows < 0 or self.device_seconds < 0:
            raise ValueError("num_rows and device_seconds must be >= 0")


@dataclass
class JobLedger:
    """One job's ledger. Flat, so it is both `ledger.json` and one dataset row."""

    job_id: str
    run_id: str
    model: str
    weights_hash: str
    engine_version: str
    input_uri: str
    output_uri: str
    started_at: str
    finished_at: str
    rows_ok: int
    rows_failed: int
    num_shards: int
    num_shards_run: int  # computed by this run; the rest were already complete
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # None: the price was not given (it charged nothing).
    price_input_per_1m: float | None
    price_cached_input_per_1m: float | None
    price_output_per_1m: float | None
    price_device_per_hour: float | None
    cost_input: float
    cost_cached_input: float
    cost_output: float
    cost_total: float
    cost_per_1k_requests: float | None
    cost_per_1m_tokens: float | None
    cost_device: float | None
    device_cost_per_1k_requests: float | None
    device_cost_per_1m_tokens: float | None
    device: str
    device_seconds: float
    throughput_tokens_per_s: float | None  # (prompt + completion) tokens per device-second
    output_tokens_per_s: float | None
    prefix_cache_hit_rate: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    # generate | score (pipelines/scoring.py: a scoring job bills prompt tokens only) |
    # embed | classify | rerank (pipelines/pooling.py: prompt tokens only, too).
    # Last, with a default: ledgers written before there were tasks are generation jobs.
    task: str = GENERATE
    # With LoRA adapters: per adapter (None: the base model) its weights hash, rows, token
    # sums and token costs (`ADAPTER_FIELDS`); a JSON text column in the ledger dataset.
    adapters: list[dict] | None = None
    # Rows answered per device-second (the figure embedding jobs are judged by); None for
    # ledgers written before it was kept.
    throughput_rows_per_s: float | None = None
    # Rows that took an identical row's answer and billed no tokens (pipelines/dedupe.py).
    rows_deduplicated: int = 0
    # The dry run's forecast of this job (pipelines/forecast.py), beside the actuals
    # above; None when the job was not forecast. Seconds: compute seconds the dry run
    # expected to run; completion tokens and cost: its estimates, with their bounds.
    forecast_prompt_tokens: int | None = None
    forecast_cached_tokens: int | None = None
    forecast_completion_tokens: int | None = None
    forecast_completion_tokens_max: int | None = None
    forecast_cost: float | None = None
    forecast_cost_min: float | None = None
    forecast_cost_max: float | None = None
    forecast_seconds: float | None = None
    # Every record the input's reader saw: rows_read = rows_ok + rows_failed +
    # rows_skipped_blank (blank records: an empty CSV record, a JSON Lines line of
    # whitespace). None in ledgers written before they were counted.
    rows_read: int | None = None
    rows_skipped_blank: int | None = None
    # How the model's weights ran: the job's own quantization mode ("int8", "int4",
    # "gguf"), or a checkpoint quantized by another tool, named by its format and scheme
    # ("compressed-tensors pack-quantized, W4A16 g64"); None: float weights.
    quantization: str | None = None
    # Of prompt_tokens, those that are images' soft tokens (as OpenAI counts them: inside
    # the prompt's tokens, reported apart); 0 for a job without images.
    image_tokens: int = 0
    # Of completion_tokens, those a reasoning model wrote inside the reasoning its chat
    # split took out (the results' reasoning_tokens column); 0 for a job that split none.
    reasoning_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> JobLedger:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        if isinstance(values.get("adapters"), str):  # a ledger dataset row
            values["adapters"] = json.loads(values["adapters"])
        return cls(**values)

    def to_arrow(self) -> pa.Table:
        """This ledger as a one-row table with the fixed `LEDGER_SCHEMA`."""
        row = self.to_dict()
        if row["adapters"] is not None:
            row["adapters"] = json.dumps(row["adapters"])
        return pa.Table.from_pylist([row], schema=LEDGER_SCHEMA)


def _arrow_type(annotation: str) -> pa.DataType:
    if annotation.startswith("int"):
        return pa.int64()
    if annotation.startswith("float"):
        return pa.float64()
    return pa.string()


# Fixed so that rows appended over months (with and without device prices) stay one schema.
# A column added later goes last; `output.read_ledger_dataset` fills it in for older rows.
LEDGER_SCHEMA = pa.schema([pa.field(f.name, _arrow_type(f.type)) for f in fields(JobLedger)])


def _price(value: float | None) -> float | None:
    return None if value is None else float(value)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def token_sums(results: pa.Table) -> dict[str, int]:
    """rows_ok, rows_failed, token sums and rows_deduplicated over a results table."""

    def total(name: str) -> int:
        value = pc.sum(results[name]).as_py()
        return int(value or 0)

    failed = int(pc.sum(pc.equal(results["finish_reason"], "error")).as_py() or 0)
    copies = 0
    if "duplicate_of" in results.column_names:
        copies = results.num_rows - results["duplicate_of"].null_count
    return {
        "rows_ok": results.num_rows - failed,
        "rows_failed": failed,
        "prompt_tokens": total("prompt_tokens"),
        "cached_tokens": total("cached_tokens"),
        "completion_tokens": total("completion_tokens"),
        "rows_deduplicated": copies,
        # Of prompt_tokens, the images' soft tokens (jobs with images have the column).
        "image_tokens": total("image_tokens") if "image_tokens" in results.column_names else 0,
        # Of completion_tokens, the reasoning's (jobs whose chat split it have the column).
        "reasoning_tokens": (
            total("reasoning_tokens") if "reasoning_tokens" in results.column_names else 0
        ),
    }


def add_token_sums(total: Mapping[str, int] | None, part: pa.Table) -> dict[str, int]:
    """`total` plus `token_sums(part)`: the sums of a job whose parts are read one by one."""
    sums = token_sums(part)
    return {k: v + total[k] for k, v in sums.items()} if total is not None else sums


AdapterSums = dict[str | None, dict[str, int]]


def add_adapter_sums(total: AdapterSums | None, part: pa.Table) -> AdapterSums:
    """`total` plus the `token_sums` of each adapter's rows of a results part (by its
    `adapter` column; None: the base model)."""
    total = {k: dict(v) for k, v in (total or {}).items()}
    if "adapter" not in part.column_names:
        return add_token_sums_into(total, None, part)
    names = part["adapter"]
    for name in pc.unique(names).to_pylist():
        rows = part.filter(pc.is_null(names) if name is None else pc.equal(names, name))
        total = add_token_sums_into(total, name, rows)
    return total


def add_token_sums_into(total: AdapterSums, name: str | None, rows: pa.Table) -> AdapterSums:
    total[name] = add_token_sums(total.get(name), rows)
    return total


def adapter_split(
    sums: AdapterSums, adapters: Sequence[tuple[str, str]], prices: Prices
) -> list[dict]:
    """`JobLedger.adapters`: the base model, then each (name, weights hash) adapter, with
    its rows, token sums and token costs."""
    split = []
    empty = dict.fromkeys(("rows_ok", "rows_failed", *TOKEN_FIELDS), 0)
    for name, weights_hash in [(None, None), *adapters]:
        counts = {k: v for k, v in sums.get(name, empty).items() if k not in JOB_ONLY_SUMS}
        costs = token_costs(
            prices,
            prompt_tokens=counts["prompt_tokens"],
            cached_tokens=counts["cached_tokens"],
            completion_tokens=counts["completion_tokens"],
            num_requests=counts["rows_ok"],
        )
        split.append(
            {
                "adapter": name,
                "weights_hash": weights_hash,
                **counts,
                **{k: getattr(costs, k) for k in ADAPTER_COSTS},
            }
        )
    return split


TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
# Sums the ledger keeps for the whole job only, not per adapter.
JOB_ONLY_SUMS = ("image_tokens", "reasoning_tokens")
ADAPTER_COSTS = ("cost_input", "cost_cached_input", "cost_output", "cost_total")


def compute_ledger(
    results: pa.Table | Mapping[str, int],
    stats: Sequence[ShardStats],
    *,
    prices: Prices,
    job_id: str,
    run_id: str,
    model: str,
    weights_hash: str,
    engine_version: str,
    input_uri: str,
    output_uri: str,
    started_at: str,
    finished_at: str,
    num_shards: int,
    num_shards_run: int,
    task: str = GENERATE,
    adapters: Sequence[tuple[str, str]] = (),
    adapter_sums: AdapterSums | None = None,
    forecast: Mapping[str, Any] | None = None,
    rows_skipped_blank: int | None = None,
    quantization: str | None,
) -> JobLedger:
    """Build a job's ledger from its result rows and its shards' stats.

    Args:
        results: every result row of the job (all parts), or their `token_sums`
            (added up part by part with `add_token_sums`).
        stats: one ShardStats per shard (from this run and earlier ones).
        prices: the prices to charge.
        started_at, finished_at: ISO times of the job's first shard and of now.
        task: generate or score; a scoring job's rows have no completion tokens, so
            its cost is the prompt tokens' at the input and cached-input prices.
        adapters: the job's LoRA adapters, (name, weights hash) each; with them,
            `adapter_sums` (`add_adapter_sums` over the parts) gives the split.
        forecast: the job's dry-run forecast (`Forecast.to_dict()`), recorded beside
            the actuals.
        rows_skipped_blank: the blank records the input's reader skipped; with it the
            ledger's rows_read adds up the records read (None: not counted).
        quantization: how the weights ran (JobLedger.quantization).
        (the rest are recorded as given; URIs are redacted of credentials)

    Returns:
        The JobLedger.
    """
    sums = token_sums(results) if isinstance(results, pa.Table) else dict(results)
    device_seconds = float(sum(s.device_seconds for s in stats))
    latencies = [x for s in stats for x in s.latencies]
    costs = token_costs(
        prices,
        prompt_tokens=sums["prompt_tokens"],
        cached_tokens=sums["cached_tokens"],
        completion_tokens=sums["completion_tokens"],
        num_requests=sums["rows_ok"],
        device_seconds=device_seconds,
    )
    num_tokens = sums["prompt_tokens"] + sums["completion_tokens"]
    rate = (lambda n: n / device_seconds) if device_seconds > 0 else (lambda n: None)
    devices = sorted({s.device for s in stats if s.device})
    return JobLedger(
        job_id=job_id,
        run_id=run_id,
        model=model,
        weights_hash=weights_hash,
        engine_version=engine_version,
        input_uri=redact_url(input_uri),
        output_uri=redact_url(output_uri),
        started_at=started_at,
        finished_at=finished_at,
        num_shards=num_shards,
        num_shards_run=num_shards_run,
        **sums,
        price_input_per_1m=_price(prices.input_per_1m),
        price_cached_input_per_1m=_price(prices.cached_input_given),
        price_output_per_1m=_price(prices.output_per_1m),
        price_device_per_hour=prices.device_per_hour,
        **asdict(costs),
        device=",".join(devices),
        device_seconds=device_seconds,
        throughput_tokens_per_s=rate(num_tokens),
        output_tokens_per_s=rate(sums["completion_tokens"]),
        prefix_cache_hit_rate=(
            sums["cached_tokens"] / sums["prompt_tokens"] if sums["prompt_tokens"] else 0.0
        ),
        latency_p50_s=percentile(latencies, 50),
        latency_p95_s=percentile(latencies, 95),
        latency_p99_s=percentile(latencies, 99),
        task=task,
        adapters=adapter_split(adapter_sums or {}, adapters, prices) if adapters else None,
        throughput_rows_per_s=rate(sums["rows_ok"]),
        **_forecast_fields(forecast),
        rows_read=(
            None
            if rows_skipped_blank is None
            else sums["rows_ok"] + sums["rows_failed"] + rows_skipped_blank
        ),
        rows_skipped_blank=rows_skipped_blank,
        quantization=quantization,
    )


# ledger field -> the forecast's field it records
FORECAST_FIELDS = {
    "forecast_prompt_tokens": "prompt_tokens",
    "forecast_cached_tokens": "cached_tokens",
    "forecast_completion_tokens": "completion_tokens_estimate",
    "forecast_completion_tokens_max": "completion_tokens_max",
    "forecast_cost": "cost_estimate",
    "forecast_cost_min": "cost_min",
    "forecast_cost_max": "cost_max",
    "forecast_seconds": "seconds_estimate",
}


def _forecast_fields(forecast: Mapping[str, Any] | None) -> dict[str, Any]:
    if forecast is None:
        return {}
    return {name: forecast.get(source) for name, source in FORECAST_FIELDS.items()}
