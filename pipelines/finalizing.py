"""Finalizing a job: check every part against the plan, write the ledger, drop the plan.

Parts are read one at a time (one window at a time for OpenAI batch output, which is
written in input order), so memory is bounded by a shard or a window. The ledger's
token sums are added up from the rows read back, so they equal the sums over the
results exactly, however many runs it took.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid

import pyarrow as pa

from tokenmill.connectors import openai_batch_output_lines, read_part
from tokenmill.connectors.openai_embeddings import EmbeddingResponses, is_embeddings_url
from tokenmill.pipelines import output as out
from tokenmill.pipelines.ledger import (
    AdapterSums,
    JobLedger,
    add_adapter_sums,
    add_token_sums,
    compute_ledger,
    now_iso,
    token_sums,
)
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, load_shard
from tokenmill.pipelines.results import RESULT_SCHEMA
from tokenmill.version import __version__

log = logging.getLogger(__name__)

TokenSums = dict[str, int]


def finalize_job(
    plan: JobPlan,
    *,
    run_id: str | None = None,
    run_started_at: str | None = None,
    num_shards_run: int = 0,
) -> JobLedger:
    """Check every part against its shard, write the ledger, and drop the plan files.

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
    spec = plan.spec
    parts = out.result_parts(spec.output, spec.storage_options)
    _check_parts_are_the_plans(plan, parts)
    per_adapter: AdapterSums = {}
    if spec.output_format == "openai-batch":
        sums = _write_openai_output(plan, parts, per_adapter)
    else:
        sums = _add_up_parts(plan, parts, per_adapter)
    _check_rows_add_up(plan, sums)
    stats = out.read_shard_stats(
        spec.output, [s.shard_id for s in plan.shards], spec.storage_options
    )
    starts = [s.started_at for s in stats] + ([run_started_at] if run_started_at else [])
    forecast = out.read_forecast(spec.output, spec.storage_options)
    if forecast is not None and forecast.get("job_id") != plan.job_id:
        forecast = None  # a dry run of another job (other input or options)
    ledger = compute_ledger(
        sums,
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
        task=spec.task,
        adapters=[(a.name, a.weights_hash) for a in plan.adapters],
        adapter_sums=per_adapter,
        forecast=forecast,
        rows_skipped_blank=plan.rows_skipped_blank,
        quantization=plan.quantization,
    )
    out.write_ledger(
        ledger,
        spec.output,
        ledger_dataset=spec.ledger_dataset,
        storage_options=spec.storage_options,
    )
    try:
        out.remove_plan(spec.output, spec.storage_options)
        out.remove_progress(spec.output, spec.storage_options)
        # A part of a spread planning that failed can finish writing after it was let go.
        out.remove_staged_windows(spec.output, spec.storage_options)
    except OSError as exc:  # the job is done; leftover plan files are only clutter
        log.warning("job %s: could not remove its plan files: %s", plan.job_id, exc)
    log.info(
        "job %s finished: %d ok, %d failed, cost %.6f USD",
        plan.job_id,
        ledger.rows_ok,
        ledger.rows_failed,
        ledger.cost_total,
    )
    return ledger


def _check_rows_add_up(plan: JobPlan, sums: TokenSums) -> None:
    """Raise RuntimeError unless every record read is a result row or a skipped blank."""
    rows = sums["rows_ok"] + sums["rows_failed"]
    if rows + plan.rows_skipped_blank != plan.rows_read:
        raise RuntimeError(
            f"results of job {plan.job_id} do not add up: {plan.rows_read} records read, "
            f"{rows} result rows and {plan.rows_skipped_blank} blank records skipped"
        )


def _check_parts_are_the_plans(plan: JobPlan, parts: dict[str, list[str]]) -> None:
    """Raise RuntimeError unless the parts are exactly the plan's shards."""
    missing = [s.shard_id for s in plan.shards if s.shard_id not in parts]
    if missing:
        raise RuntimeError(
            f"job {plan.job_id} is incomplete: {len(missing)} of {len(plan.shards)} shards "
            f"have no results part (e.g. {missing[0]}); run the job again to finish them"
        )
    foreign = sorted(set(parts) - {s.shard_id for s in plan.shards})
    if foreign:
        raise RuntimeError(
            f"results of job {plan.job_id} do not match its plan: {len(foreign)} part(s) "
            f"are not shards of this job (e.g. {foreign[0]})"
        )


def _add_up_parts(
    plan: JobPlan, parts: dict[str, list[str]], per_adapter: AdapterSums
) -> TokenSums:
    """Token sums over every shard's part, each checked against its shard (and, for a
    job with LoRA adapters, added to `per_adapter` by adapter)."""
    sums = token_sums(RESULT_SCHEMA.empty_table())
    for shard in plan.shards:
        results, _ = _checked_part(plan, shard, parts[shard.shard_id], columns=["id"])
        sums = add_token_sums(sums, results)
        _add_per_adapter(plan, per_adapter, results)
    return sums


def _add_per_adapter(plan: JobPlan, per_adapter: AdapterSums, results: pa.Table) -> None:
    if plan.adapters:
        per_adapter.update(add_adapter_sums(per_adapter, results))


def _write_openai_output(
    plan: JobPlan, parts: dict[str, list[str]], per_adapter: AdapterSums
) -> TokenSums:
    """Check and add up every part, and write `OUTPUT/results.jsonl` from them in input
    order, in one pass over the parts.

    A window's shards (its copy shard included, which comes after every compute shard)
    cover a contiguous range of rows, so sorting each window's rows by row index and
    writing the windows in order gives the input order. The file is written atomically:
    a part that fails its check leaves no output file behind. /v1/embeddings rows are
    joined into one response per request line (`connectors/openai_embeddings.py`),
    whichever windows its rows fell in.
    """
    spec = plan.spec
    sums = token_sums(RESULT_SCHEMA.empty_table())
    created = int(time.time())
    embeddings = EmbeddingResponses(model_name=plan.model_name, batch_id=plan.job_id)
    by_window = sorted(plan.shards, key=lambda shard: shard.window)  # stable: plan order kept
    with out.openai_results_writer(spec.output, spec.storage_options) as write:
        for _, shards in itertools.groupby(by_window, key=lambda shard: shard.window):
            tables = []
            for shard in shards:
                # The plan file is read with the columns the output lines need too, so no
                # part or plan file is read twice.
                results, planned = _checked_part(
                    plan,
                    shard,
                    parts[shard.shard_id],
                    columns=[
                        "id",
                        "row_index",
                        "url",
                        "tool_calls",
                        "params_index",
                        "max_tokens_requested",
                    ],
                )
                sums = add_token_sums(sums, results)
                _add_per_adapter(plan, per_adapter, results)
                tables.append(_with_plan_columns(plan, results, planned))
            window = pa.concat_tables(tables, promote_options="permissive").sort_by("_row_index")
            window = window.drop_columns(["_row_index"])
            for is_embedding, run in _runs_by_endpoint(window):
                if is_embedding:
                    lines = embeddings.add(run.to_pylist())
                else:
                    lines = [
                        *embeddings.flush(),
                        *openai_batch_output_lines(
                            run, model_name=plan.model_name, batch_id=plan.job_id, created=created
                        ),
                    ]
                for line in lines:
                    write(line)
        for line in embeddings.flush():
            write(line)
    return sums


def _runs_by_endpoint(window: pa.Table):
    """(is /v1/embeddings, table) for each run of consecutive rows of one kind."""
    kinds = [is_embeddings_url(url) for url in window["url"].to_pylist()]
    start = 0
    for end in range(1, len(kinds) + 1):
        if end == len(kinds) or kinds[end] != kinds[start]:
            yield kinds[start], window.slice(start, end - start)
            start = end


def _checked_part(
    plan: JobPlan, shard: Shard, urls: list[str], *, columns: list[str]
) -> tuple[pa.Table, pa.Table]:
    """A shard's results and its plan file (`columns` of it), once the results are
    checked to hold exactly the shard's planned ids, once each.

    Raises:
        RuntimeError: they do not.
    """
    tables = [read_part(url, plan.spec.storage_options) for url in urls]
    # Normally one part; more only if a part was duplicated.
    results = (
        tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
    )
    planned = load_shard(plan, shard, columns=columns)
    ids = results["id"].to_pylist() if results.num_rows else []
    expected = set(planned["id"].to_pylist())
    if len(ids) != shard.num_rows or len(set(ids)) != len(ids) or set(ids) != expected:
        raise RuntimeError(
            f"results of job {plan.job_id} do not match its plan: shard {shard.shard_id} "
            f"has {len(ids)} rows ({len(set(ids))} distinct ids) for {shard.num_rows} "
            "planned rows"
        )
    return results, planned


def _with_plan_columns(plan: JobPlan, results: pa.Table, planned: pa.Table) -> pa.Table:
    """`results` with each row's request url, how its answer is read as tool calls, the
    budget it asked for and ran with when that was capped to the context left
    (`max_tokens_capped`, null when not), and its input position (`_row_index`)."""
    where = {rid: i for i, rid in enumerate(planned["id"].to_pylist())}
    take = pa.array([where[rid] for rid in results["id"].to_pylist()], pa.int64())
    results = results.append_column("url", planned["url"].take(take))
    results = results.append_column("tool_calls", planned["tool_calls"].take(take))
    requested = planned["max_tokens_requested"].take(take).to_pylist()
    indices = planned["params_index"].take(take).to_pylist()
    capped = [
        None if asked is None else {"requested": asked, "applied": plan.params[i].max_tokens}
        for asked, i in zip(requested, indices)
    ]
    results = results.append_column("max_tokens_capped", pa.array(capped, _CAPPED_TYPE))
    return results.append_column("_row_index", planned["row_index"].take(take))


_CAPPED_TYPE = pa.struct([("requested", pa.int64()), ("applied", pa.int64())])
