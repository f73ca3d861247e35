"""A batch job in three separately callable steps: plan, run shards, finalize.

    plan_job(spec)             read + template + tokenize + shard, window by window,
                               writing each shard's rows to OUTPUT/_plan/; every input
                               problem raises here, before the model is loaded
                               (pipelines/planning.py)
    run_shard(llm, plan, s)    read one shard's rows, generate, publish its part;
                               idempotent (pipelines/running.py)
    finalize_job(plan, ...)    check the parts one by one, write the ledger, drop _plan/
                               (pipelines/finalizing.py)

`run_job` composes them; the Prefect flows call them as separate tasks, so their
inputs and outputs are plain picklable dataclasses. Prompts and outputs are never
logged - only counts.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from tokenmill.engine.outputs import RequestOutput
from tokenmill.pipelines.finalizing import finalize_job
from tokenmill.pipelines.ledger import JobLedger, now_iso
from tokenmill.pipelines.option_types import JOB
from tokenmill.pipelines.options import check_names, takes_options
from tokenmill.pipelines.output_lock import claimed_output
from tokenmill.pipelines.plan import Shard
from tokenmill.pipelines.planning import JobPlan, load_shard, plan_job
from tokenmill.pipelines.running import ShardResult, prepare_output, run_shard
from tokenmill.pipelines.spec import JobSpec

__all__ = [
    "JobPlan",
    "JobProgress",
    "JobSpec",
    "ShardResult",
    "finalize_job",
    "load_shard",
    "plan_job",
    "prepare_output",
    "run_job",
    "run_shard",
]


class JobProgress:
    """Hooks `run_job` calls as it goes; override any of them (e.g. a progress bar)."""

    def planned(self, plan: JobPlan, pending: list[Shard]) -> None:
        """The plan is ready and the model loaded; `pending` shards will be computed."""

    def request_done(self, output: RequestOutput) -> None:
        """One request finished."""

    def shard_done(self, result: ShardResult) -> None:
        """One shard's part is published."""


@takes_options(JOB)
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
    skipped, and the results hold exactly one row per input row. The run holds the
    output's lock throughout (`claimed_output`): a second run on the same output is
    refused, and temporary files a killed run left behind are removed first.

    Args:
        input: dataset URL or path.
        output: output directory URL or path.
        llm: an already loaded LLM to use (default: the process's shared engine for
            the job's model and engine options, `engine.llm_cache`).
        progress: hooks for progress reporting.
        **options: the job options (model, template, max_tokens, temperature,
            price_input, shard_tokens, storage_options, resume, ...): every JOB option
            of `pipelines/options.py`, as the signature lists them.

    Returns:
        The JobLedger.

    Raises:
        OutputLockedError: another run is writing to `output`.
        DiskFullError: the output's filesystem is full; rerun once space is freed.
    """
    check_names(options, surface=JOB)  # a clearer error than JobSpec's own TypeError
    spec = JobSpec(input, output, **options)
    progress = progress or JobProgress()
    run_started_at = now_iso()
    with claimed_output(spec.output, spec.storage_options):
        plan = plan_job(spec, llm=llm)
        done = prepare_output(plan)
        pending = [s for s in plan.shards if s.shard_id not in done]
        llm_lock: Any = nullcontext()
        if pending and llm is None:
            from tokenmill.pipelines.shared_llm import get_llm

            shared = get_llm(**spec.llm_options)
            llm, llm_lock = shared.llm, shared.lock
        progress.planned(plan, pending)
        with llm_lock:
            for shard in pending:
                result = run_shard(llm, plan, shard, on_output=progress.request_done)
                progress.shard_done(result)
        return finalize_job(plan, run_started_at=run_started_at, num_shards_run=len(pending))
