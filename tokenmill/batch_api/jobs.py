"""A batch as a tokenmill job, and its end: the job's options, stopping what has not run,
and the output and error files cut from the job's OpenAI batch output.

A batch is an ordinary job (`pipelines/job.py`): input the uploaded file, output the
batch's directory on the store, OpenAI batch formats both ways. Every runner - in
process or a Prefect flow run - runs it through the pipeline's own stages, and resumes
it the way any job resumes: from its published parts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tokenmill.batch_api.database import Database, now
from tokenmill.batch_api.ids import FILE_PREFIX
from tokenmill.batch_api.models import ServedModels
from tokenmill.batch_api.settings import ServerSettings
from tokenmill.batch_api.store import Store, spool_file
from tokenmill.connectors import openai_batch_output_lines
from tokenmill.pipelines import output as out
from tokenmill.pipelines.planning import JobPlan
from tokenmill.pipelines.running import run_shard, stop_shard
from tokenmill.pipelines.spec import JobSpec

log = logging.getLogger(__name__)

# Why a request of a stopped batch has no answer: (OpenAI's error code, message).
CANCELLED = ("batch_cancelled", "The batch was cancelled before this request was executed.")
EXPIRED = (
    "batch_expired",
    "This request could not be executed before the completion window expired.",
)
OUTPUT_PURPOSE = "batch_output"


@dataclass
class ServerState:
    """What the API's routers and the runner share."""

    settings: ServerSettings
    db: Database
    store: Store
    models: ServedModels


def job_options(state: ServerState, batch: dict[str, Any]) -> dict[str, Any]:
    """The job options a batch runs with: the server's defaults, then what makes it this
    batch's job (its model and adapters, formats, store, ledger)."""
    model = next(m for m in state.models.models if m.id == batch["model"])
    return {
        **state.settings.job_options,
        "model": model.spec,
        "lora": model.adapters or None,
        "format": "openai-batch",
        "output_format": "openai-batch",
        "storage_options": state.settings.storage_options,
        "ledger_dataset": state.store.ledger_url,
    }


def job_spec(state: ServerState, batch: dict[str, Any]) -> JobSpec:
    return JobSpec(
        state.store.file_url(batch["input_file_id"]),
        state.store.batch_url(batch["id"]),
        **job_options(state, batch),
    )


def stop_pending(llm: Any, plan: JobPlan, *, reason: tuple[str, str]) -> None:
    """Answer every shard not yet complete with error rows (`reason`), so the job can be
    finalized keeping what finished: compute shards are stopped, then copy shards run,
    taking their sources' answers or errors."""
    done = out.completed_shards(plan.spec.output, plan.spec.storage_options)
    code, message = reason
    for shard in plan.shards:
        if shard.shard_id not in done and not shard.is_copy:
            stop_shard(plan, shard, error=message, error_code=code)
    for shard in plan.shards:
        if shard.shard_id not in done and shard.is_copy:
            run_shard(llm, plan, shard)


@dataclass
class Outcome:
    """A finished job's files and counts, for the Batch object."""

    output_file_id: str | None
    error_file_id: str | None
    completed: int
    failed: int


def publish_outputs(state: ServerState, batch: dict[str, Any]) -> Outcome:
    """Cut the job's OpenAI batch output (one line per request) into the batch's output
    file (answers) and error file (error lines), each registered as a file of the
    batch's owner; a file that would be empty is not made."""
    source = out.join(state.store.batch_url(batch["id"]), out.OPENAI_RESULTS_FILE)
    fs = state.store.fs
    spool_dir = state.settings.spool_dir
    with (
        spool_file(spool_dir) as (answers, answers_path),
        spool_file(spool_dir) as (errors, errors_path),
    ):
        counts = [0, 0]
        with fs.open(source, "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                failed = json.loads(raw).get("error") is not None
                (errors if failed else answers).write(raw.rstrip(b"\n") + b"\n")
                counts[failed] += 1
        answers.flush()
        errors.flush()
        output_id = _register(state, batch, answers_path, counts[0], "output")
        error_id = _register(state, batch, errors_path, counts[1], "error")
    return Outcome(output_id, error_id, counts[0], counts[1])


def publish_unstarted(
    state: ServerState, batch: dict[str, Any], reason: tuple[str, str]
) -> Outcome:
    """The error file of a batch stopped before it ran: one error line per request."""
    code, message = reason
    ids = []
    with state.store.open_file(batch["input_file_id"]) as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                line = _json_object(raw)
                custom_id = line.get("custom_id")
                ids.append(custom_id if isinstance(custom_id, str) else f"line-{number}")
    rows = pa.table(
        {
            "id": ids,
            "output": pa.nulls(len(ids), pa.string()),
            "finish_reason": ["error"] * len(ids),
            "prompt_tokens": [0] * len(ids),
            "completion_tokens": [0] * len(ids),
            "error": [message] * len(ids),
            "error_code": [code] * len(ids),
        }
    )
    lines = openai_batch_output_lines(rows, model_name=batch["model"] or "-", batch_id=batch["id"])
    with spool_file(state.settings.spool_dir) as (spool, path):
        for line in lines:
            spool.write(line.encode() + b"\n")
        spool.flush()
        error_id = _register(state, batch, path, len(ids), "error")
    return Outcome(None, error_id, 0, len(ids))


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _register(
    state: ServerState, batch: dict[str, Any], path: str, num_lines: int, kind: str
) -> str | None:
    if not num_lines:
        return None
    # Named after the batch: a server killed while finishing finishes again into the
    # same file, not a second one.
    digest = hashlib.sha256(f"{batch['id']}\x00{kind}".encode()).hexdigest()
    file_id = f"{FILE_PREFIX}{digest[:24]}"
    state.store.put_file(file_id, path, overwrite=True)
    if state.db.file(batch["owner"], file_id) is not None:
        return file_id
    created = now()
    keep = batch.get("output_expires_s") or state.settings.retention_s
    state.db.add_file(
        id=file_id,
        owner=batch["owner"],
        filename=f"{batch['id']}_{kind}.jsonl",
        purpose=OUTPUT_PURPOSE,
        bytes=os.path.getsize(path),
        lines=num_lines,
        created_at=created,
        expires_at=created + int(keep),
    )
    return file_id


def usage_of(ledger: Any) -> dict[str, int]:
    """A job ledger's token sums as the batch's usage columns."""
    return {
        "input_tokens": ledger.prompt_tokens,
        "cached_tokens": ledger.cached_tokens,
        "output_tokens": ledger.completion_tokens,
        "reasoning_tokens": ledger.reasoning_tokens,
    }
