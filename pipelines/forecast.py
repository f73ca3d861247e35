"""The bill before the job runs: tokens, cost and time, from the plan.

Planning already reads, templates, tokenizes, deduplicates, orders and shards every
row, so before any compute the forecast knows, exactly:

    prompt_tokens       the sum over the rows the engine will compute (copies bill none)
    cached_tokens       what the prefix cache will serve given the plan's order, the
                        block size and the engine's cache capacity - the number the
                        ledger will report (`LLM.plan`: exact whenever the cache cannot
                        have to evict; otherwise `cached_tokens_exact` is false, the
                        figure is the engine's loop run with the calibrated completion
                        lengths, and `cached_tokens_min`/`_max` bound it). An encoder
                        (embed, classify, rerank on a BERT-family model) keeps no cache:
                        0; a decoder's pooling rows replay as the scheduler serves them
    completion bounds   min: one token per completion (or min_tokens); max: the budget;
                        scoring and pooling rows: none

and, from a short calibration run on this machine (`calibration.py`), estimates of the
completion tokens and of the compute seconds (the ledger's `device_seconds`). Costs are
token costs at the job's prices: `cost_min` and `cost_max` bound what the ledger will
charge when every row computes (a row the engine fails bills nothing, which can only
lower it); `cost_estimate` uses the completion estimate; `device_cost_estimate` prices
the estimated seconds at the device-hour price.

A resumed job's finished shards are counted from their parts (exact), the rest
forecast; `seconds_estimate` is then the time still to run. The forecast assumes the
run starts with an empty prefix cache, as a new `tokenmill run` process or flow worker
does; an engine already warm in a notebook may serve more from its cache.

A job cut for several workers (`Work.shard_calls`) runs each shard on whichever worker
is free, so a shard may or may not find what an earlier shard left in its worker's
cache. Its cached tokens then range from each shard replayed on a cold cache (the
floor, which holds for every shard on any worker) to all shards on one engine (the
figure above); they are exact when the two agree, as they do when no shard's rows
share a cached block with another shard's (cuts between prefix groups, `prefix_cut.py`,
leave only what every row shares, such as a system prompt).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from tokenmill.engine import (
    LLM,
    MemoryPlan,
    Plan,
    PlannedRequest,
    PoolingParams,
    SamplingParams,
    engine_settings,
)
from tokenmill.pipelines.calibration import Calibration, calibrate, sample_indices
from tokenmill.pipelines.pricing import Prices, token_costs

# The most tokens a forecast replays through the engine's loop to time a job (about a
# minute of simulation); a larger job is timed on evenly spread shards and scaled up.
SIMULATED_TOKENS = 4_000_000

# `LLM.plan` for the engine that will run a job: batches -> Plan (simulate=True runs the
# engine's loop with each request's completion_tokens).
Planner = Callable[..., Plan]


def engine_planner(llm_options: dict[str, Any], model_dir: Any, llm: Any = None) -> Planner:
    """`LLM.plan` of the engine a job's LLM options build for a model: the loaded LLM's
    own (`llm`), else the one they would build, sized without loading anything."""
    if llm is not None and getattr(llm, "engine", None) is not None:
        return llm.plan
    names = {f.name for f in engine_settings()}
    settings = {k: v for k, v in llm_options.items() if k in names}
    return functools.partial(LLM.plan, model=model_dir, **settings)


@dataclass
class Forecast:
    """A job's forecast (see the module docstring); flat, so it is one JSON object."""

    job_id: str | None
    task: str
    model: str
    device: str
    rows: int
    rows_failed: int  # fail before compute (bad or over-long prompt): bill nothing
    rows_deduplicated: int  # take an identical row's answer: bill nothing
    rows_computed: int
    shards: int
    shards_done: int  # already complete (resume): counted from their parts
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_exact: bool
    cached_tokens_min: int
    cached_tokens_max: int
    completion_tokens_min: int
    completion_tokens_max: int
    completion_tokens_estimate: int | None
    cost_min: float
    cost_max: float
    cost_estimate: float | None
    seconds_estimate: float | None  # compute seconds still to run (the ledger's device_seconds)
    device_cost_estimate: float | None
    prices_set: bool  # a token price was given (else its costs read "no prices set")
    calibration_rows: int | None  # sample rows that finished
    calibration_rows_sampled: int | None
    calibration_seconds: float | None
    block_size: int
    cache_blocks: int
    planning_seconds: float | None = None
    # The engine's memory, planned before its load (`MemoryPlan`; None: not planned).
    weight_bytes: int | None = None
    # The weights the engine keeps after the load (MemoryPlan.held_bytes; None: the peak).
    held_weight_bytes: int | None = None
    kv_cache_bytes: int | None = None
    memory_available_bytes: int | None = None
    memory_dtype: str | None = None
    # How many sequences run at once (MemoryPlan.describe_rows): the user's max_num_seqs
    # (None: the KV cache decides), and the job's longest prompt + max_tokens.
    max_num_seqs: int | None = None
    longest_row_tokens: int | None = None
    # Of prompt_tokens, images' soft tokens: exact, from the plan (each image's tokens are
    # fixed by the model; its header was checked, its pixels never decoded).
    image_tokens: int = 0

    @property
    def memory(self) -> MemoryPlan | None:
        if self.weight_bytes is None or self.memory_dtype is None:
            return None
        return MemoryPlan(
            self.device,
            self.memory_dtype,
            self.weight_bytes,
            self.kv_cache_bytes or 0,
            self.cache_blocks,
            self.memory_available_bytes,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            held_bytes=self.held_weight_bytes,
        )

    @property
    def rows_at_once(self) -> int | None:
        """Sequences the engine runs at once on this job's longest rows (None: not planned)."""
        memory = self.memory
        if memory is None or not memory.kv_cache_blocks or self.longest_row_tokens is None:
            return None
        return memory.rows_at_once(self.longest_row_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Forecast:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class Work:
    """What a forecast is made of: the requests still to compute, call by call, and what
    is known of the rest."""

    batches: list[list[PlannedRequest]]  # per generate call (shard), rows in run order
    rows: int
    rows_failed: int = 0
    rows_deduplicated: int = 0
    shards: int = 1
    shards_done: int = 0
    done_sums: dict[str, int] | None = None  # token sums of finished shards' rows
    # A job for several workers: `batches` grouped by shard (each shard's calls), whose
    # shards may each start on a cold cache (the module docstring).
    shard_calls: list[list[list[PlannedRequest]]] | None = None


def forecast_work(
    work: Work,
    *,
    planner: Planner,
    prices: Prices,
    task: str,
    model: str,
    job_id: str | None = None,
    llm: Any = None,
) -> Forecast:
    """Forecast `work` on the engine `planner` plans for; with a loaded `llm`, calibrated
    on it.

    Args:
        work: the requests to compute and the finished part.
        planner: `LLM.plan` of the engine that will run them (`engine_planner`).
        prices: the job's prices.
        task, model, job_id: recorded in the forecast.
        llm: a loaded LLM to calibrate on (None: no calibration, no estimates).

    Returns:
        The Forecast.
    """
    plan = planner(work.batches)
    requests = plan.requests
    exact = plan.cached_tokens_exact
    cached = sum(plan.cached_tokens)
    cached_max = cached
    cached_min = cached if exact else 0
    if work.shard_calls is not None and requests:
        cold = sum(sum(planner(calls).cached_tokens) for calls in work.shard_calls if calls)
        exact = exact and cold == cached
        cached_min = min(cached_min, cold)
    completion_min = sum(
        0 if r.is_prompt_only else r.params.n * max(1, r.params.min_tokens) for r in requests
    )
    completion_max = sum(r.params.n * r.params.max_tokens for r in requests)
    estimate = seconds = None
    calibration: Calibration | None = None
    if llm is not None and requests:
        calibration = _calibrate(llm, requests, plan)
        budgets = [r.params.n * r.params.max_tokens for r in requests]
        lengths = [
            calibration.completion_tokens(i, b) // max(1, r.params.n)
            for i, (r, b) in enumerate(zip(requests, budgets))
        ]
        estimate = sum(r.params.n * n for r, n in zip(requests, lengths))
        seconds, simulated_cached = _timed(plan.batches, lengths, planner, calibration)
        if not exact and simulated_cached is not None:
            cached = simulated_cached
    prompt = sum(len(r.token_ids) for r in requests)
    done = work.done_sums or {}
    prompt += done.get("prompt_tokens", 0)
    cached, cached_min, cached_max = (
        c + done.get("cached_tokens", 0) for c in (cached, cached_min, cached_max)
    )
    finished = done.get("completion_tokens", 0)
    completion_min += finished
    completion_max += finished
    if estimate is not None:
        estimate += finished
    costs = _cost_range(prices, prompt, cached_min, cached_max, completion_min, completion_max)
    cost_estimate = device_cost = None
    if estimate is not None:
        cost_estimate = _cost(prices, prompt, cached, estimate)
    if seconds is not None and prices.device_per_hour is not None:
        device_cost = token_costs(
            prices,
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            num_requests=0,
            device_seconds=seconds,
        ).cost_device
    return Forecast(
        job_id=job_id,
        task=task,
        model=model,
        device=plan.shape.device,
        rows=work.rows,
        rows_failed=work.rows_failed,
        rows_deduplicated=work.rows_deduplicated,
        rows_computed=len(requests),
        shards=work.shards,
        shards_done=work.shards_done,
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_tokens_exact=exact,
        cached_tokens_min=cached_min,
        cached_tokens_max=cached_max,
        completion_tokens_min=completion_min,
        completion_tokens_max=completion_max,
        completion_tokens_estimate=estimate,
        cost_min=costs[0],
        cost_max=costs[1],
        cost_estimate=cost_estimate,
        seconds_estimate=seconds,
        device_cost_estimate=device_cost,
        prices_set=prices.has_token_prices,
        calibration_rows=calibration.num_rows if calibration else None,
        calibration_rows_sampled=calibration.num_rows_sampled if calibration else None,
        calibration_seconds=calibration.seconds if calibration else None,
        block_size=plan.block_size,
        cache_blocks=plan.shape.num_blocks,
        longest_row_tokens=_longest_row(requests, plan.shape.max_model_len),
        **_memory_fields(plan.shape.memory),
    )


def _memory_fields(memory: MemoryPlan | None) -> dict[str, Any]:
    if memory is None:
        return {}
    return {
        "weight_bytes": memory.weight_bytes,
        "held_weight_bytes": memory.held_bytes,
        "kv_cache_bytes": memory.kv_cache_bytes,
        "memory_available_bytes": memory.available_bytes,
        "memory_dtype": memory.dtype,
        "max_num_seqs": memory.max_num_seqs,
    }


def _longest_row(requests: list[PlannedRequest], max_model_len: int) -> int | None:
    """The most tokens one of `requests`' sequences reaches: its prompt + max_tokens (a
    prompt alone where nothing is generated), at most the context. None: no request."""
    if not requests:
        return None
    return min(
        max_model_len,
        max(len(r.token_ids) + (0 if r.is_prompt_only else r.params.max_tokens) for r in requests),
    )


def _calibrate(llm: Any, requests: list[PlannedRequest], plan: Plan) -> Calibration:
    chosen = sample_indices(len(requests), plan.shape.config.seq_cap)
    return calibrate(llm, [requests[i] for i in chosen])


def _timed(
    batches: list[list[PlannedRequest]],
    lengths: list[int],
    planner: Planner,
    calibration: Calibration,
) -> tuple[float, int | None]:
    """(estimated seconds, cached tokens when every batch was simulated) of the batches
    with the calibrated completion lengths, through the engine's own loop."""
    scripted: list[list[PlannedRequest]] = []
    i = 0
    for batch in batches:
        scripted.append(
            [replace(r, completion_tokens=n) for r, n in zip(batch, lengths[i : i + len(batch)])]
        )
        i += len(batch)
    sizes = [sum(len(r.token_ids) + r.params.n * r.completion_tokens for r in b) for b in scripted]
    chosen = _spread(sizes, SIMULATED_TOKENS)
    sim = planner([scripted[i] for i in chosen], simulate=True).simulation
    seconds = calibration.step_cost.seconds(sim.steps)
    if len(chosen) == len(scripted):
        return calibration.warm_up_s + seconds, sum(sim.cached_tokens)
    scale = sum(sizes) / max(1, sum(sizes[i] for i in chosen))
    return calibration.warm_up_s + seconds * scale, None


def _spread(sizes: Sequence[int], budget: int) -> list[int]:
    """Indices of batches to simulate: all of them when they fit `budget` tokens, else
    evenly spread ones that do (at least one)."""
    if sum(sizes) <= budget:
        return list(range(len(sizes)))
    mean = max(1, sum(sizes) // len(sizes))
    count = max(1, min(len(sizes), budget // mean))
    return sorted({int(k * len(sizes) / count) for k in range(count)})


def _cost(prices: Prices, prompt: int, cached: int, completion: int) -> float:
    return token_costs(
        prices,
        prompt_tokens=prompt,
        cached_tokens=min(cached, prompt),
        completion_tokens=completion,
        num_requests=0,
    ).cost_total


def _cost_range(
    prices: Prices,
    prompt: int,
    cached_min: int,
    cached_max: int,
    completion_min: int,
    completion_max: int,
) -> tuple[float, float]:
    """(least, most) token cost over the cached and completion ranges."""
    cheaper_cached = prices.cached_input <= prices.input
    low_cached, high_cached = (
        (cached_max, cached_min) if cheaper_cached else (cached_min, cached_max)
    )
    return (
        _cost(prices, prompt, low_cached, completion_min),
        _cost(prices, prompt, high_cached, completion_max),
    )


def requests_of(
    rows: Sequence[Any], params: Sequence[SamplingParams | PoolingParams]
) -> list[PlannedRequest]:
    """Prompt rows (with token ids) as the requests the engine will see."""
    return [
        PlannedRequest(r.token_ids, params[r.params_index]) for r in rows if r.token_ids is not None
    ]
