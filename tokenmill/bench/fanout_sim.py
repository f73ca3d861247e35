"""The batch flow on many Dask workers with a sleeping engine: the fan-out's coordination
costs, measured at worker counts no machine here has the cores for.

    run = run_sleep_fanout(workers=64, shards_per_worker=4, shard_seconds=2.0, workdir=...)
    run.costs                       # per-shard hand-out and commit, planning, finalize
    predict(run)                    # fanout_model's wall for those costs and shards

Everything is the real flow - its plan, its Prefect task runs, the `engine` resource
placement, each shard's rows read from the plan files, its part and stats committed to
the output, the ledger - except the engine. Each worker of an in-process Dask cluster
(`LocalCluster(processes=False)`: threads, one per worker, one `engine` resource each)
gets its own `SleepEngine`, which answers a shard's rows after sleeping
`shard_seconds`. Its compute costs no CPU, so the machine's cores go to what is being
measured: the scheduler, the Prefect API calls, the part writes.

Recorded per shard, in this process (the workers are its threads):

    task start      the shard task asks for its engine (`acquire_llm`, first thing it does)
    compute         the engine's generate call: the sleep
    commit          the part and its stats written (`pipelines/output.write_shard`)

and from those (`ShardCosts`) the costs the scale model takes: the hand-out (the
spacing of the first wave's shard task starts, while every worker is free: the flow
submitting task runs and the scheduler starting them one after another) as its serial
dispatch, the worker's own time besides the compute (its rows read, results built,
the part written) as its commit, planning (flow start -> first shard task) and
finalize (last part -> the flow's end).

`meet=N` makes the first N shards' engines wait for each other before computing (a
barrier): N shards can only all compute if they run at once, one per worker, which
is what placement by the `engine` resource promises.

An in-process cluster runs all its workers' Python under one interpreter lock, on the
machine's few cores: what is serial here may be parallel on a real cluster of 64
machines, so the measured wall is an upper bound on the coordination's cost there, and
the model - which serializes only the scheduler's dispatch - is checked against it,
not fitted to it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.fanout_model import FanoutCosts, FanoutRun, simulate
from tokenmill.engine import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

# Tokens the sleeping engine answers each row with (any id of the model's vocabulary).
ANSWER_TOKEN = 42
# How long the first `meet` shards wait for each other before giving up.
MEET_TIMEOUT_S = 120.0


@dataclass
class ShardTimes:
    """One shard's moments on its worker (time.monotonic seconds)."""

    worker: str
    task_start: float
    compute_start: float = 0.0
    compute_end: float = 0.0
    commit_end: float = 0.0


@dataclass
class _Recorder:
    """What the sleeping engines and the patched part writer saw, by worker."""

    meet: int = 0  # the first `meet` computes wait for each other (module docstring)
    lock: threading.Lock = field(default_factory=threading.Lock)
    shards: list[ShardTimes] = field(default_factory=list)
    current: dict[str, ShardTimes] = field(default_factory=dict)
    computes: int = 0

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.meet) if self.meet > 1 else None

    def start(self, worker: str) -> None:
        with self.lock:
            times = ShardTimes(worker, time.monotonic())
            self.shards.append(times)
            self.current[worker] = times

    def mark(self, worker: str, name: str) -> None:
        with self.lock:
            setattr(self.current[worker], name, time.monotonic())

    def compute_starts(self, worker: str) -> None:
        """Marks a compute's start; one of the first `meet` waits for the others first
        (BrokenBarrierError after MEET_TIMEOUT_S: they never all ran at once)."""
        with self.lock:
            self.computes += 1
            meets = self.barrier is not None and self.computes <= self.meet
        if meets:
            self.barrier.wait(timeout=MEET_TIMEOUT_S)
        self.mark(worker, "compute_start")


class SleepEngine:
    """An engine that answers every row with one token after sleeping `seconds`: one
    per Dask worker, so workers never wait on each other's engine."""

    def __init__(self, model_dir: str, seconds: float, worker: str, recorder: _Recorder):
        self.model_dir = Path(model_dir)
        self.device = "sleep"
        self.seconds, self.worker, self.recorder = seconds, worker, recorder
        self.engine_stats = EngineStats()

    def stats(self) -> EngineStats:
        return self.engine_stats

    def generate(self, prompts, sampling_params=None, *, on_output=None, on_step=None):
        self.recorder.compute_starts(self.worker)
        time.sleep(self.seconds)
        params = sampling_params if isinstance(sampling_params, list) else None
        outputs = []
        now = time.perf_counter()
        for i, ids in enumerate(prompts):
            sp = params[i] if params else (sampling_params or SamplingParams())
            n = min(1, sp.max_tokens)
            output = RequestOutput(
                request_id=str(i),
                prompt=None,
                prompt_token_ids=list(ids),
                outputs=[CompletionOutput(0, "", [ANSWER_TOKEN] * n, "length")],
                prompt_tokens=len(ids),
                cached_tokens=0,
                completion_tokens=n,
                metrics=RequestMetrics(arrival_time=now, finish_time=now),
            )
            self.engine_stats.num_requests += 1
            self.engine_stats.prompt_tokens += len(ids)
            self.engine_stats.computed_prompt_tokens += len(ids)
            self.engine_stats.generated_tokens += n
            outputs.append(output)
            if on_output is not None:
                on_output(output)
        if on_step is not None:
            on_step(self.engine_stats)
        self.recorder.mark(self.worker, "compute_end")
        return outputs


@contextmanager
def sleeping_engines(
    model_dir: str, weights_hash: str, seconds: float, meet: int = 0
) -> Iterator[_Recorder]:
    """Within: every shard task of this process's Dask workers gets its worker's
    SleepEngine instead of loading a model, and every part commit is timed."""
    from distributed import get_worker

    from tokenmill.pipelines import output as out
    from tokenmill.pipelines import shared_llm

    recorder = _Recorder(meet)
    engines: dict[str, shared_llm.SharedLLM] = {}
    real_acquire, real_preload, real_write = (
        shared_llm.acquire_llm,
        shared_llm.preload,
        out.write_shard,
    )

    def acquire_llm(*args: Any, **kwargs: Any) -> tuple[shared_llm.SharedLLM, bool]:
        worker = get_worker().address
        recorder.start(worker)
        with recorder.lock:
            loaded = worker not in engines
            if loaded:
                engine = SleepEngine(model_dir, seconds, worker, recorder)
                shared = shared_llm.SharedLLM(engine, key=("sleep", worker), pid=0)
                shared.weights_hash = weights_hash  # what planning recorded for the model
                engines[worker] = shared
        return engines[worker], loaded

    def write_shard(*args: Any, **kwargs: Any) -> Any:
        try:
            return real_write(*args, **kwargs)
        finally:
            recorder.mark(get_worker().address, "commit_end")

    def preload(*args: Any, **kwargs: Any) -> None:
        """A sleeping engine needs no loading ahead: it is made on its first shard."""

    shared_llm.acquire_llm, shared_llm.preload, out.write_shard = acquire_llm, preload, write_shard
    try:
        yield recorder
    finally:
        shared_llm.acquire_llm, shared_llm.preload, out.write_shard = (
            real_acquire,
            real_preload,
            real_write,
        )


@dataclass(frozen=True)
class ShardCosts:
    """The per-shard and per-job costs read from one run (medians over its shards)."""

    hand_out_s: float  # between shard task starts while workers wait: the serial dispatch
    worker_s: float  # a shard task's own time besides its compute: rows read, part written
    commit_s: float  # the compute's end -> part and stats written (within worker_s)
    gap_s: float  # a worker's part committed -> its next shard task (waits included)
    planning_s: float  # flow start -> first shard task
    finalize_s: float  # last part committed -> flow end

    def model(self) -> FanoutCosts:
        """The scale model's costs: the hand-out as its serial dispatch, the worker's
        own time as its per-shard commit."""
        return FanoutCosts(self.hand_out_s, 0.0, self.worker_s, self.planning_s, self.finalize_s)


def costs_from(shards: list[ShardTimes], flow_start: float, flow_end: float) -> ShardCosts:
    """The costs of the recorded shards (see the module docstring). Raises ValueError if
    a shard never reached its commit."""
    unfinished = [s for s in shards if not s.commit_end]
    if unfinished or not shards:
        raise ValueError(f"{len(unfinished)} of {len(shards)} shards have no commit recorded")
    by_worker: dict[str, list[ShardTimes]] = {}
    for s in sorted(shards, key=lambda s: s.task_start):
        by_worker.setdefault(s.worker, []).append(s)
    gaps = [
        b.task_start - a.commit_end for runs in by_worker.values() for a, b in zip(runs, runs[1:])
    ]
    # The first `workers` starts: every worker is free then, so what spaces them out
    # is the scheduler handing out one task after another.
    starts = sorted(s.task_start for s in shards)[: len(by_worker)]
    return ShardCosts(
        hand_out_s=statistics.median(b - a for a, b in zip(starts, starts[1:]))
        if len(starts) > 1
        else 0.0,
        worker_s=statistics.median(
            (s.commit_end - s.task_start) - (s.compute_end - s.compute_start) for s in shards
        ),
        commit_s=statistics.median(s.commit_end - s.compute_end for s in shards),
        gap_s=statistics.median(gaps) if gaps else 0.0,
        planning_s=starts[0] - flow_start,
        finalize_s=flow_end - max(s.commit_end for s in shards),
    )


@dataclass(frozen=True)
class SleepFanoutRun:
    """A measured run and the costs read from it."""

    workers: int
    num_shards: int
    shard_seconds: float
    wall_s: float  # the flow call, start to end
    shards_per_worker: dict[str, int]  # by worker address: shard tasks that computed
    costs: ShardCosts
    cpu_s: float  # this process's CPU seconds during the flow (all workers, the driver)
    rows: int
    ledger_rows_ok: int
    computes: int  # the sleeping engines' generate calls (a retried one counts again)
    met: bool  # the first `meet` shards computed together (True without a meet)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "shards": self.num_shards,
            "shard_seconds": self.shard_seconds,
            "wall_s": round(self.wall_s, 3),
            "workers_used": len(self.shards_per_worker),
            "shard_tasks": sum(self.shards_per_worker.values()),
            "computes": self.computes,
            "cpu_s": round(self.cpu_s, 2),
            "rows": self.rows,
            "ledger_rows_ok": self.ledger_rows_ok,
            **{k: round(v, 4) for k, v in vars(self.costs).items()},
        }


def run_sleep_fanout(
    *,
    workers: int,
    shards_per_worker: int,
    shard_seconds: float,
    workdir: Path,
    meet: int = 0,
    model: str | None = None,
) -> SleepFanoutRun:
    """The flow on an in-process cluster of `workers` sleeping engines, on a JSONL job
    cut into about `workers * shards_per_worker` shards (local output under workdir);
    the first `meet` shards compute only once all of them have started (a barrier).
    Planning reads `model`'s tokenizer and hashes its weights (default: the default
    model); no engine is loaded. Needs a Prefect API (PREFECT_API_URL)."""
    import resource

    from distributed import LocalCluster

    from tokenmill.engine import DEFAULT_MODEL, resolve_model, weights_hash
    from tokenmill.flows import batch_inference, make_task_runner
    from tokenmill.flows.runners import ENGINE_RESOURCE
    from tokenmill.pipelines import output as out

    rows_per_shard = 4
    rows = workers * shards_per_worker * rows_per_shard
    source = workdir / "prompts.jsonl"
    with open(source, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"Question {i}: what is {i} + 1?"}) + "\n")
    model = model or DEFAULT_MODEL
    model_dir = str(resolve_model(model))
    output = str(workdir / "out")
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=False,
            dashboard_address=None,
            resources={ENGINE_RESOURCE: 1},
            # Each in-process worker would count the whole process's memory against its
            # own share of the machine's, and pause.
            memory_limit=0,
        ) as cluster,
        sleeping_engines(model_dir, weights_hash(model_dir), shard_seconds, meet) as recorder,
    ):
        flow = batch_inference.with_options(
            task_runner=make_task_runner(dask_address=cluster.scheduler_address)
        )
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        ledger = flow(
            input=str(source),
            output=output,
            model=model,
            id_column="id",
            max_tokens=1,
            # a row is about 45 tokens templated, 1 generated: rows_per_shard rows a shard
            shard_tokens=rows_per_shard * 50,
            dedupe=False,
        )
        end = time.monotonic()
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    computed: dict[str, int] = {}
    for s in recorder.shards:
        computed[s.worker] = computed.get(s.worker, 0) + 1
    return SleepFanoutRun(
        workers=workers,
        num_shards=len(out.completed_shards(output)),
        shard_seconds=shard_seconds,
        wall_s=end - start,
        shards_per_worker=computed,
        costs=costs_from(recorder.shards, start, end),
        cpu_s=(cpu_after.ru_utime + cpu_after.ru_stime)
        - (cpu_before.ru_utime + cpu_before.ru_stime),
        rows=rows,
        ledger_rows_ok=ledger.rows_ok,
        computes=recorder.computes,
        met=recorder.barrier is None or not recorder.barrier.broken,
    )


def predict(run: SleepFanoutRun) -> FanoutRun:
    """fanout_model's run of the measured run's shards and workers at its costs."""
    return simulate([run.shard_seconds] * run.num_shards, run.workers, run.costs.model())
