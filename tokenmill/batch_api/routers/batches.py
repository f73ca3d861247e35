"""/v1/batches: create, list (cursor pages, newest first), retrieve, cancel."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from tokenmill.batch_api.auth import caller, server_state
from tokenmill.batch_api.database import now
from tokenmill.batch_api.errors import APIError, not_found
from tokenmill.batch_api.ids import is_batch_id, new_batch_id
from tokenmill.batch_api.jobs import ServerState
from tokenmill.batch_api.routers.files import UPLOAD_PURPOSE, owned_file
from tokenmill.batch_api.runner import CANCELLING, OPEN, QUEUED, RUNNING
from tokenmill.batch_api.schemas import (
    Batch,
    BatchCreate,
    BatchErrors,
    BatchList,
    BatchUsage,
    InputTokensDetails,
    OutputTokensDetails,
    RequestCounts,
)

router = APIRouter(prefix="/v1/batches", tags=["batches"])


def batch_object(row: dict) -> Batch:
    total = row["total"]
    usage = BatchUsage(
        input_tokens=row["input_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=row["cached_tokens"]),
        output_tokens=row["output_tokens"],
        output_tokens_details=OutputTokensDetails(reasoning_tokens=row["reasoning_tokens"]),
        total_tokens=row["input_tokens"] + row["output_tokens"],
    )
    return Batch(
        id=row["id"],
        endpoint=row["endpoint"],
        model=row["model"],
        errors=BatchErrors(data=row["errors"]) if row["errors"] else None,
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        created_at=row["created_at"],
        in_progress_at=row["in_progress_at"],
        expires_at=row["expires_at"],
        finalizing_at=row["finalizing_at"],
        completed_at=row["completed_at"],
        failed_at=row["failed_at"],
        expired_at=row["expired_at"],
        cancelling_at=row["cancelling_at"],
        cancelled_at=row["cancelled_at"],
        # While it runs, counts are of result rows (an embeddings line may have several).
        request_counts=RequestCounts(
            total=total,
            completed=min(row["completed"], total),
            failed=min(row["failed"], total),
        ),
        usage=usage,
        metadata=row["metadata"],
    )


def owned_batch(state: ServerState, owner: str, batch_id: str) -> dict:
    row = state.db.batch(owner, batch_id) if is_batch_id(batch_id) else None
    if row is None:
        raise not_found("batch", batch_id if is_batch_id(batch_id) else "(malformed id)")
    return row


@router.post("", response_model=Batch)
def create_batch(
    request: Request,
    body: BatchCreate,
    owner: str = Depends(caller),
    state: ServerState = Depends(server_state),
) -> Batch:
    settings = state.settings
    source = owned_file(state, owner, body.input_file_id)
    if source["purpose"] != UPLOAD_PURPOSE:
        raise APIError(
            400,
            f"input_file_id must name a file uploaded with purpose {UPLOAD_PURPOSE!r}",
            param="input_file_id",
        )
    queued = state.db.queued_lines(owner, OPEN)
    if queued + source["lines"] > settings.max_queued_lines_per_key:
        raise APIError(
            429,
            f"this key has {queued:,} request lines queued or running; with this file's "
            f"{source['lines']:,} it would pass the limit of "
            f"{settings.max_queued_lines_per_key:,}: wait for a batch to finish",
            type="rate_limit_exceeded",
            code="queue_limit_exceeded",
        )
    created = now()
    row = state.db.add_batch(
        id=new_batch_id(),
        owner=owner,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status=QUEUED,
        num_lines=source["lines"],
        metadata=body.metadata,
        output_expires_s=body.output_expires_after.seconds if body.output_expires_after else None,
        created_at=created,
        expires_at=created + int(settings.completion_window_s),
        total=source["lines"],
        completed=0,
        failed=0,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        reasoning_tokens=0,
        work_removed=0,
    )
    request.app.state.runner.wake()
    return batch_object(row)


@router.get("", response_model=BatchList)
def list_batches(
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    owner: str = Depends(caller),
    state: ServerState = Depends(server_state),
) -> BatchList:
    rows, more = state.db.list_batches(owner, after=after, limit=limit)
    return BatchList.of([batch_object(r) for r in rows], more)


@router.get("/{batch_id}", response_model=Batch)
def retrieve_batch(
    batch_id: str, owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> Batch:
    return batch_object(owned_batch(state, owner, batch_id))


@router.post("/{batch_id}/cancel", response_model=Batch)
def cancel_batch(
    request: Request,
    batch_id: str,
    owner: str = Depends(caller),
    state: ServerState = Depends(server_state),
) -> Batch:
    row = owned_batch(state, owner, batch_id)
    if row["status"] not in (QUEUED, RUNNING, CANCELLING):
        raise APIError(
            409,
            f"batch {batch_id} is {row['status']}: only a batch validating or in progress "
            "can be cancelled",
            code="batch_not_cancellable",
        )
    state.db.transition(batch_id, (QUEUED, RUNNING), status=CANCELLING, cancelling_at=now())
    request.app.state.runner.request_stop(batch_id)
    return batch_object(state.db.batch_by_id(batch_id))
