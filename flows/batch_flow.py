"""`batch_inference`: a tokenmill batch job as a Prefect flow.

    plan_task (on a worker) -> prepare_output_task -> shard_task per pending shard
                            -> ledger_task (ledger.json, ledger dataset, artifacts)

The flow only orchestrates; every stage is a call into `tokenmill.pipelines.job`.
Its parameters are the job's options, typed, so Prefect validates them (UI forms,
`prefect deployment run -p`, `flow(...)` calls) before the run starts; `JobSpec`
then checks how they combine. Shards fan out over the flow's task runner: threads
by default, a Dask or Ray cluster with `batch_inference.with_options(task_runner=
make_task_runner(...))`.

Rerunning the flow with the same parameters resumes the job: shards whose part is
in the output are not submitted again, and the ledger is rebuilt from all parts.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter schema from
# the annotations, and a served flow run (a subprocess given the pickled flow) cannot
# resolve string annotations such as "PositiveInt" back to their types.
import logging
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from prefect import flow, get_run_logger, unmapped
from prefect.futures import wait
from prefect.runtime import flow_run
from pydantic import Field

from tokenmill.connectors.fs import redact_url
from tokenmill.flows.parameters import build_spec, expand_placeholders
from tokenmill.flows.runners import make_task_runner
from tokenmill.flows.tasks import (
    ShardRun,
    ledger_task,
    plan_task,
    prepare_output_task,
    shard_task,
)
from tokenmill.pipelines.job import JobPlan, now_iso
from tokenmill.pipelines.ledger import JobLedger
from tokenmill.pipelines.plan import DEFAULT_PLAN_WINDOW_ROWS, DEFAULT_SHARD_TOKENS

FLOW_NAME = "batch-inference"

PositiveInt = Annotated[int, Field(ge=1)]
NonNegative = Annotated[float, Field(ge=0)]


def _flow_run_name() -> str:
    # The job id is a hash of the planned shards, unknown until planning; the run is
    # renamed to `job <id> -> <output>` once the plan exists (see `_name_after_plan`).
    return f"tokenmill -> {redact_url(flow_run.parameters['output'])}"


@flow(
    name=FLOW_NAME,
    flow_run_name=_flow_run_name,
    task_runner=make_task_runner(),
    log_prints=False,
)
def batch_inference(
    input: str,
    output: str,
    model: str | None = None,
    format: str | None = None,
    prompt_column: str | None = "prompt",
    messages_column: str | None = None,
    template: str | None = None,
    system: str | None = None,
    chat: bool = False,
    id_column: str | None = None,
    passthrough: list[str] | None = None,
    max_tokens: PositiveInt = 256,
    temperature: NonNegative = 0.0,
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0,
    top_k: Annotated[int, Field(ge=0)] = 0,
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    price_input: NonNegative = 0.0,
    price_cached: NonNegative | None = None,
    price_output: NonNegative = 0.0,
    price_device_hour: NonNegative | None = None,
    shard_tokens: PositiveInt = DEFAULT_SHARD_TOKENS,
    plan_window_rows: PositiveInt = DEFAULT_PLAN_WINDOW_ROWS,
    limit: PositiveInt | None = None,
    resume: bool = True,
    output_format: Literal["parquet", "jsonl", "openai-batch"] = "parquet",
    ledger_dataset: str | None = None,
    storage_options: dict[str, Any] | None = None,
    storage_secret: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    engine_options: dict[str, Any] | None = None,
) -> JobLedger:
    """Run a tokenmill batch job: prompts in, results and a token-cost ledger out.

    Args:
        input: dataset URL or path (Parquet, JSONL, CSV, OpenAI batch; any fsspec URL).
            `{date}` / `{datetime}` are replaced by the run's scheduled time (UTC).
        output: output directory URL or path (results parts, ledger.json, ledger/);
            `{date}` / `{datetime}` as for input, so each scheduled run has its own.
        model: model directory, .gguf file or alias; default smollm2-135m-instruct.
        format: input format; detected from file names when not given.
        prompt_column: column holding the prompt text.
        messages_column: column holding chat messages (rendered with the chat template).
        template: a str.format template over columns, e.g. "Summarise: {text}".
        system: system prompt (implies the chat template).
        chat: wrap prompt/template text in the model's chat template.
        id_column: column with each row's id (default: the row number).
        passthrough: input columns copied into the results.
        max_tokens: completion budget per row.
        temperature: 0 is greedy (reproducible across reruns and workers).
        top_p: nucleus sampling threshold.
        top_k: top-k sampling (0 disables it).
        min_p: min-p sampling threshold (0 disables it).
        seed: sampling seed per request.
        stop: stop strings.
        price_input: USD per 1M uncached prompt tokens.
        price_cached: USD per 1M cached prompt tokens (default: the input price).
        price_output: USD per 1M completion tokens.
        price_device_hour: USD per device-hour (optional device cost).
        shard_tokens: token budget of one shard (prompt + max completion tokens).
        plan_window_rows: input rows ordered and cut into shards together; planning
            memory grows with this, not with the dataset.
        limit: only the first N input rows.
        resume: skip shards already complete in the output; false recomputes all.
        output_format: "parquet", "jsonl" or "openai-batch".
        ledger_dataset: where the job's ledger row goes (default OUTPUT/ledger/).
        storage_options: non-secret filesystem options (e.g. endpoint_url).
        storage_secret: name of a Prefect Secret block holding storage options with
            credentials (a JSON object), merged over storage_options at run time.
        dtype: "auto", "float32" or "bfloat16" (the model dtype on the workers).
        device: "cpu", "cuda", "cuda:N"; default CUDA when the worker has it.
        engine_options: more LLM(...) options (kv_cache_memory, max_num_seqs, ...).

    Returns:
        The job's JobLedger (also in OUTPUT/ledger.json and the ledger dataset).
    """
    logger = get_run_logger()
    run_started_at = now_iso()
    scheduled = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    spec = build_spec(
        input=expand_placeholders(input, scheduled),
        output=expand_placeholders(output, scheduled),
        model=model,
        format=format,
        prompt_column=prompt_column,
        messages_column=messages_column,
        template=template,
        system=system,
        chat=chat,
        id_column=id_column,
        passthrough=tuple(passthrough or ()),
        sampling={
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "seed": seed,
            "stop": list(stop or ()),
        },
        prices={
            "input_per_1m": price_input,
            "cached_input_per_1m": price_cached,
            "output_per_1m": price_output,
            "device_per_hour": price_device_hour,
        },
        shard_tokens=shard_tokens,
        plan_window_rows=plan_window_rows,
        limit=limit,
        resume=resume,
        output_format=output_format,
        ledger_dataset=expand_placeholders(ledger_dataset, scheduled),
        storage_options=storage_options,
        storage_secret=storage_secret,
        dtype=dtype,
        device=device,
        engine_options=dict(engine_options or {}),
    )
    # Submitted, not called: on a cluster the plan then stays on the worker that made
    # it, and each shard task's worker fetches it from there once (not once per shard).
    plan_future = plan_task.submit(spec)
    plan = plan_future.result()
    _name_after_plan(plan, logger)
    done = prepare_output_task(plan)
    pending = [s for s in plan.shards if s.shard_id not in done]
    logger.info(
        "job %s: %d rows in %d shards; %d already complete, %d to run",
        plan.job_id,
        plan.num_rows,
        len(plan.shards),
        len(plan.shards) - len(pending),
        len(pending),
    )
    futures = shard_task.map(
        plan=unmapped(plan_future), shard=pending, job_id=unmapped(plan.job_id)
    )
    runs = _shard_runs(plan, futures)
    return ledger_task(
        plan,
        run_id=str(flow_run.id),
        run_started_at=run_started_at,
        num_shards_run=sum(1 for r in runs if not r.result.skipped),
    )


def _name_after_plan(plan: JobPlan, logger: logging.LoggerAdapter) -> None:
    """Rename the running flow run after its job id (best effort: a name is cosmetic)."""
    from prefect import get_client

    name = f"job {plan.job_id} -> {redact_url(plan.spec.output)}"
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:  # the run goes on under its first name
        logger.warning("could not rename the flow run to %r: %s", name, exc)


def _shard_runs(plan: JobPlan, futures: list) -> list[ShardRun]:
    """Wait for every shard, then fail if any failed.

    All shards are waited for before failing, so one bad shard does not cancel the
    work of the others: their parts are kept, and a rerun computes only what failed.
    """
    wait(futures)
    runs: list[ShardRun] = []
    failed: list[str] = []
    for shard_future in futures:
        state = shard_future.state
        if state.is_completed():
            runs.append(shard_future.result())
        else:
            failed.append(state.name or "failed")
    if failed:
        raise RuntimeError(
            f"job {plan.job_id}: {len(failed)} of {len(futures)} shard tasks did not complete; "
            "their errors are in the task runs' logs. Completed shards are kept: run the flow "
            "again with the same parameters to finish the job."
        )
    return runs
