"""A batch job in three separately callable steps: plan, run shards, finalize.

    plan_job(spec)             read + template + tokenize + shard; every input problem
                               (bad file, missing column, duplicate ids) raises here,
                               before the model is loaded
    run_shard(llm, plan, s)    generate one shard and publish its part; idempotent
    finalize_job(plan, ...)    read the parts back, write the ledger

`run_job` composes them; the Prefect flows call them as separate tasks, so their
inputs and outputs are plain picklable dataclasses. Prompts and outputs are never
logged - only counts.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from tokenmill.connectors import open_source
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines import output as out
from tokenmill.pipelines.ledger import JobLedger, ShardStats, compute_ledger
from tokenmill.pipelines.plan import Shard, job_id, plan_shards
from tokenmill.pipelines.reading import read_rows
from tokenmill.pipelines.results import build_results, latencies
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.templating import required_columns, text_columns
from tokenmill.pipelines.tokenize import PromptRow

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]


@dataclass
class JobPlan:
    """A planned job: every row (by row index) tokenized or failed, cut into shards."""

    spec: JobSpec
    job_id: str
    model_name: str
    model_dir: str
    weights_hash: str
    max_model_len: int
    params: list[SamplingParams]
    rows: list[PromptRow]  # indexed by row_index
    shards: list[Shard]
    passthrough: pa.Table | None = None  # passthrough columns, one row per row_index
    endpoints: list[str | None] | None = None  # OpenAI batch: each row's request url

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


@dataclass
class ShardResult:
    """What running one shard did (counts only)."""

    shard_id: str
    skipped: bool  # already complete: nothing was computed
    num_rows: int
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    device_seconds: float = 0.0


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def model_name(model: str | None) -> str:
    """How the ledger names a model: the alias, or a directory's or file's base name."""
    from tokenmill.engine.model_files import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    return path.name if path.exists() else str(model)


def _canonical_location(uri: str) -> str:
    # "out", "./out" and "/abs/out" are one place, so they are one job.
    return uri if "://" in uri else os.path.abspath(uri)


def _model_facts(model: str | None) -> tuple[str, int, str]:
    """(model dir, context length, weights hash) without loading any weights."""
    from tokenmill.engine.config import ModelConfig
    from tokenmill.engine.model_files import resolve_model, weights_hash

    model_dir = resolve_model(model)
    return (
        str(model_dir),
        ModelConfig.from_dir(model_dir).max_context,
        weights_hash(model_dir),
    )


def plan_job(spec: JobSpec, *, tokenizer: Any = None, llm: Any = None) -> JobPlan:
    """Read, template, tokenize and shard a job - everything before compute.

    The source is opened and validated first (missing file, corrupt file, bad URL,
    missing column -> `SourceError` naming the file), then the model's files are
    resolved (no weights are loaded), then the rows are read and tokenized.

    Args:
        spec: the job.
        tokenizer: the model's tokenizer (default: loaded from the model directory).
        llm: an already loaded LLM; its tokenizer and context length are used.

    Returns:
        The JobPlan.

    Raises:
        ValueError: bad input (SourceError), duplicate or null ids, bad options.
    """
    template = spec.template_spec
    columns = None if spec.is_openai_batch else [*required_columns(template), *spec.passthrough]
    source = open_source(
        spec.input,
        format=spec.format,
        storage_options=spec.storage_options,
        columns=list(dict.fromkeys(columns)) if columns is not None else None,
        on_bad_line="skip_row",
        text_columns=text_columns(template),
    )
    if llm is not None:
        model_dir, max_len = str(llm.model_dir), llm.max_model_len
        from tokenmill.engine.model_files import weights_hash

        w_hash = weights_hash(model_dir)
        tokenizer = tokenizer or llm.tokenizer
    else:
        model_dir, max_len, w_hash = _model_facts(spec.model)
        max_len = min(max_len, spec.engine_options.get("max_model_len") or max_len)
    if tokenizer is None:
        from tokenmill.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
    read = read_rows(source, spec, tokenizer, max_model_len=max_len)
    shards = plan_shards(read.rows, read.params, model_key=w_hash, shard_tokens=spec.shard_tokens)
    plan = JobPlan(
        spec=spec,
        job_id=job_id(shards, output=_canonical_location(spec.output)),
        model_name=model_name(getattr(llm, "model_name", None) if llm is not None else spec.model),
        model_dir=model_dir,
        weights_hash=w_hash,
        max_model_len=max_len,
        params=read.params,
        rows=read.rows,
        shards=shards,
        passthrough=read.passthrough,
        endpoints=read.endpoints,
    )
    num_failed = sum(1 for r in plan.rows if r.error is not None)
    log.info(
        "planned job %s: %d rows (%d failed before compute), %d shards, ~%d tokens",
        plan.job_id,
        plan.num_rows,
        num_failed,
        len(shards),
        plan.num_tokens,
    )
    return plan


def prepare_output(plan: JobPlan) -> set[str]:
    """Check the output directory against the plan; return the shards already complete.

    With resume on, parts that are not shards of this plan mean the directory holds
    another job's results, which a rerun must not mix with its own: that raises. With
    resume off, earlier results are removed first.
    """
    spec = plan.spec
    if not spec.resume:
        removed = out.remove_results(spec.output, spec.storage_options)
        if removed:
            log.info("resume off: removed %d earlier result parts", removed)
        return set()
    done = out.completed_shards(spec.output, spec.storage_options)
    foreign = sorted(done - {s.shard_id for s in plan.shards})
    if foreign:
        raise ValueError(
            f"{out.results_uri(spec.output)} holds {len(foreign)} part(s) that are not shards of "
            f"this job (e.g. {foreign[0]}): the input, model or options changed since they were "
            "written. Use a new output location, or resume=False (--no-resume) to replace them."
        )
    return done


def run_shard(
    llm: Any, plan: JobPlan, shard: Shard, *, on_output: OnOutput | None = None
) -> ShardResult:
    """Generate one shard's rows and publish its results part.

    Idempotent: a shard whose part already exists is skipped, so a retried or resumed
    task never computes or writes a shard twice.

    Args:
        llm: a loaded `tokenmill.engine.llm.LLM` (anything with its `generate`).
        plan: the job plan.
        shard: one of `plan.shards`.
        on_output: called with each RequestOutput as it finishes (progress bars).

    Returns:
        The ShardResult.
    """
    spec = plan.spec
    if spec.resume and out.part_exists(
        spec.output, shard.shard_id, spec.part_format, spec.storage_options
    ):
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    rows = [plan.rows[i] for i in shard.row_indices]
    good = [r for r in rows if r.token_ids is not None]
    started_at, t0 = now_iso(), time.perf_counter()
    outputs: dict[int, RequestOutput] = {}
    if good:
        generated = llm.generate(
            [r.token_ids for r in good],
            [plan.params[r.params_index] for r in good],
            on_output=on_output,
        )
        outputs = {r.row_index: o for r, o in zip(good, generated)}
    seconds = time.perf_counter() - t0
    passthrough = None
    if plan.passthrough is not None:
        passthrough = plan.passthrough.take(pa.array(shard.row_indices, pa.int64()))
    table = build_results(rows, outputs, passthrough=passthrough)
    stats = ShardStats(
        shard_id=shard.shard_id,
        num_rows=len(rows),
        device=str(getattr(llm, "device", "")),
        device_seconds=seconds if good else 0.0,
        started_at=started_at,
        finished_at=now_iso(),
        latencies=latencies(outputs),
    )
    try:
        out.write_shard(
            spec.output, table, stats, fmt=spec.part_format, storage_options=spec.storage_options
        )
    except FileExistsError:
        # Another worker published this shard first; its part stands, ours is dropped.
        log.info("shard %s was completed elsewhere meanwhile; keeping that part", shard.shard_id)
        return ShardResult(shard.shard_id, skipped=True, num_rows=shard.num_rows)
    result = _shard_result(shard.shard_id, table, stats.device_seconds)
    log.info(
        "shard %s: %d rows (%d failed), %.2fs",
        shard.shard_id,
        result.num_rows,
        result.rows_failed,
        result.device_seconds,
    )
    return result


def _shard_result(shard_id: str, table: pa.Table, seconds: float) -> ShardResult:
    rows = table.to_pydict()
    return ShardResult(
        shard_id=shard_id,
        skipped=False,
        num_rows=table.num_rows,
        rows_failed=sum(1 for r in rows["finish_reason"] if r == "error"),
        prompt_tokens=sum(rows["prompt_tokens"]),
        cached_tokens=sum(rows["cached_tokens"]),
        completion_tokens=sum(rows["completion_tokens"]),
        device_seconds=seconds,
    )


def finalize_job(
    plan: JobPlan,
    *,
    run_id: str | None = None,
    run_started_at: str | None = None,
    num_shards_run: int = 0,
) -> JobLedger:
    """Read every part back, check it against the plan, and write the ledger.

    The ledger's token sums come from the rows read back, so they equal the sums
    over the results exactly, however many runs it took.

    Args:
        plan: the job plan.
        run_id: this run's id (default: a new uuid).
        run_started_at: when this run started (ISO); the ledger's start is the earliest
            of this and the shards' own start times.
        num_shards_run: how many shards this run computed (for the ledger).

    Returns:
        The JobLedger, also written to `OUTPUT/ledger.json` and the ledger dataset.

    Raises:
        RuntimeError: shards are missing or the parts do not match the plan.
    """
    from tokenmill import __version__

    spec = plan.spec
    done = out.completed_shards(spec.output, spec.storage_options)
    missing = [s.shard_id for s in plan.shards if s.shard_id not in done]
    if missing:
        raise RuntimeError(
            f"job {plan.job_id} is incomplete: {len(missing)} of {len(plan.shards)} shards "
            f"have no results part (e.g. {missing[0]}); run the job again to finish them"
        )
    results = out.read_results(spec.output, spec.storage_options)
    _check_results(plan, results)
    stats = out.read_shard_stats(
        spec.output, [s.shard_id for s in plan.shards], spec.storage_options
    )
    starts = [s.started_at for s in stats] + ([run_started_at] if run_started_at else [])
    ledger = compute_ledger(
        results,
        stats,
        prices=spec.prices,
        job_id=plan.job_id,
        run_id=run_id or uuid.uuid4().hex,
        model=plan.model_name,
        weights_hash=plan.weights_hash,
        engine_version=__version__,
        input_uri=spec.input,
        output_uri=spec.output,
        started_at=min(starts) if starts else now_iso(),
        finished_at=now_iso(),
        num_shards=len(plan.shards),
        num_shards_run=num_shards_run,
    )
    out.write_ledger(
        ledger,
        spec.output,
        ledger_dataset=spec.ledger_dataset,
        storage_options=spec.storage_options,
    )
    if spec.output_format == "openai-batch":
        _write_openai_results(plan, results)
    log.info(
        "job %s finished: %d ok, %d failed, cost %.6f USD",
        plan.job_id,
        ledger.rows_ok,
        ledger.rows_failed,
        ledger.cost_total,
    )
    return ledger


def _check_results(plan: JobPlan, results: pa.Table) -> None:
    ids = results["id"].to_pylist() if results.num_rows else []
    expected = {r.id for r in plan.rows}
    if len(ids) != len(set(ids)) or set(ids) != expected:
        raise RuntimeError(
            f"results of job {plan.job_id} do not match its plan: {len(ids)} rows "
            f"({len(set(ids))} distinct ids) for {len(expected)} input rows"
        )


def _write_openai_results(plan: JobPlan, results: pa.Table) -> None:
    from tokenmill.connectors import openai_batch_output_lines

    order = {r.id: r.row_index for r in plan.rows}
    indices = sorted(range(results.num_rows), key=lambda i: order[results["id"][i].as_py()])
    ordered = results.take(pa.array(indices, pa.int64()))
    urls = [plan.endpoints[order[i]] for i in ordered["id"].to_pylist()] if plan.endpoints else None
    if urls is not None:
        ordered = ordered.append_column("url", pa.array(urls, pa.string()))
    lines = openai_batch_output_lines(ordered, model_name=plan.model_name, batch_id=plan.job_id)
    out.write_openai_results(plan.spec.output, lines, plan.spec.storage_options)


class JobProgress:
    """Hooks `run_job` calls as it goes; override any of them (e.g. a progress bar)."""

    def planned(self, plan: JobPlan, pending: list[Shard]) -> None:
        """The plan is ready; `pending` shards will be computed."""

    def request_done(self, output: RequestOutput) -> None:
        """One request finished."""

    def shard_done(self, result: ShardResult) -> None:
        """One shard's part is published."""


def load_llm(spec: JobSpec) -> Any:
    """Load the job's model (the one expensive step `plan_job` avoids)."""
    from tokenmill.engine.llm import LLM

    return LLM(spec.model, dtype=spec.dtype, device=spec.device, **spec.engine_options)


def run_job(
    input: str,
    output: str,
    *,
    llm: Any = None,
    progress: JobProgress | None = None,
    **options: Any,
) -> JobLedger:
    """Run a batch job end to end: plan, compute the missing shards, write the ledger.

    Rerunning the same job into the same output resumes it: complete shards are
    skipped, and the results hold exactly one row per input row.

    Args:
        input: dataset URL or path.
        output: output directory URL or path.
        llm: an already loaded LLM to use (default: load `model` when there is work).
        progress: hooks for progress reporting.
        **options: any other `JobSpec` field (model, template, sampling, prices,
            shard_tokens, storage_options, resume, ...). Sampling may be given as
            `sampling=SamplingParams(...)`, or as its fields (max_tokens, temperature,
            top_p, top_k, min_p, seed, stop, ...).

    Returns:
        The JobLedger.
    """
    spec = JobSpec(input, output, **_spec_options(options))
    progress = progress or JobProgress()
    run_started_at = now_iso()
    plan = plan_job(spec, llm=llm)
    done = prepare_output(plan)
    pending = [s for s in plan.shards if s.shard_id not in done]
    if pending and llm is None:
        llm = load_llm(spec)
    progress.planned(plan, pending)
    for shard in pending:
        result = run_shard(llm, plan, shard, on_output=progress.request_done)
        progress.shard_done(result)
    return finalize_job(plan, run_started_at=run_started_at, num_shards_run=len(pending))


_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def _spec_options(options: dict[str, Any]) -> dict[str, Any]:
    """Split sampling fields (max_tokens=...) out of run_job's options into SamplingParams."""
    options = dict(options)
    sampling = {k: options.pop(k) for k in list(options) if k in _SAMPLING_FIELDS}
    if sampling:
        if "sampling" in options:
            raise ValueError("give sampling=SamplingParams(...) or its fields, not both")
        options["sampling"] = SamplingParams(**{"temperature": 0.0, **sampling})
    if "prices" in options and isinstance(options["prices"], dict):
        from tokenmill.pipelines.pricing import Prices

        options["prices"] = Prices(**options["prices"])
    return options
