"""/v1/files: upload (streamed, checked, then stored), list, retrieve, download, delete."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.batch_api.auth import caller, server_state
from tokenmill.batch_api.database import now
from tokenmill.batch_api.errors import APIError, is_store_failure, not_found, store_unavailable
from tokenmill.batch_api.ids import is_file_id, new_file_id
from tokenmill.batch_api.jobs import ServerState
from tokenmill.batch_api.runner import OPEN
from tokenmill.batch_api.schemas import FileDeleted, FileList, FileObject
from tokenmill.batch_api.store import spool_file
from tokenmill.batch_api.uploads import count_request_lines, receive_upload

router = APIRouter(prefix="/v1/files", tags=["files"])

UPLOAD_PURPOSE = "batch"


def file_object(row: dict) -> FileObject:
    return FileObject(
        id=row["id"],
        bytes=row["bytes"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        filename=row["filename"],
        purpose=row["purpose"],
    )


def owned_file(state: ServerState, owner: str, file_id: str) -> dict:
    """The caller's file `file_id`; 404 for anything else, before any lookup when the id
    is not of our shape."""
    row = state.db.file(owner, file_id) if is_file_id(file_id) else None
    if row is None:
        raise not_found("file", file_id if is_file_id(file_id) else "(malformed id)")
    return row


@router.post("", response_model=FileObject)
async def upload_file(
    request: Request, owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> FileObject:
    settings = state.settings
    with spool_file(settings.spool_dir) as (spool, path):
        form = await receive_upload(
            request.stream(),
            request.headers.get("content-type", ""),
            spool,
            limit=settings.max_upload_bytes,
        )
        purpose = form.fields.get("purpose")
        if purpose != UPLOAD_PURPOSE:
            raise APIError(
                400,
                f"purpose must be {UPLOAD_PURPOSE!r}: this server runs batches, and keeps no "
                "other files; nothing was stored",
                param="purpose",
                code="invalid_purpose",
            )
        keep_s = _expires_after(form.fields, settings.retention_s)
        num_lines = await run_in_threadpool(count_request_lines, spool)
        file_id = new_file_id()
        try:
            await run_in_threadpool(state.store.put_file, file_id, path)
        except Exception as exc:
            if not is_store_failure(exc):
                raise
            raise store_unavailable(exc) from None
        created = now()
        row = state.db.add_file(
            id=file_id,
            owner=owner,
            filename=form.filename,
            purpose=purpose,
            bytes=form.num_bytes,
            lines=num_lines,
            created_at=created,
            expires_at=created + keep_s,
        )
    return file_object(row)


def _expires_after(fields: dict[str, str], default_s: float) -> int:
    """The file's lifetime: `expires_after[seconds]` (anchor created_at), or the default."""
    seconds = fields.get("expires_after[seconds]")
    if seconds is None:
        return int(default_s)
    if fields.get("expires_after[anchor]", "created_at") != "created_at":
        raise APIError(400, "expires_after.anchor must be created_at", param="expires_after")
    if not seconds.isdigit() or not 3600 <= int(seconds) <= 30 * 24 * 3600:
        raise APIError(
            400, "expires_after.seconds must be 3600-2592000", param="expires_after.seconds"
        )
    return int(seconds)


@router.get("", response_model=FileList)
def list_files(
    after: str | None = None,
    limit: int = Query(10_000, ge=1, le=10_000),
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
    owner: str = Depends(caller),
    state: ServerState = Depends(server_state),
) -> FileList:
    rows, more = state.db.list_files(owner, purpose=purpose, after=after, limit=limit, order=order)
    return FileList.of([file_object(r) for r in rows], more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(
    file_id: str, owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> FileObject:
    return file_object(owned_file(state, owner, file_id))


@router.get("/{file_id}/content")
def file_content(
    file_id: str, owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> StreamingResponse:
    owned_file(state, owner, file_id)
    try:
        chunks = state.store.iter_file(file_id)
        first = next(chunks, b"")  # opens the file: a store failure is answered here
    except Exception as exc:
        if not is_store_failure(exc):
            raise
        raise store_unavailable(exc) from None

    def body():
        yield first
        yield from chunks

    return StreamingResponse(body(), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(
    file_id: str, owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> FileDeleted:
    owned_file(state, owner, file_id)
    users = state.db.batches_using(owner, file_id, OPEN)
    if users:
        raise APIError(
            409,
            f"file {file_id} is the input of batch {users[0]}, which has not finished: "
            "cancel it first",
            code="file_in_use",
        )
    try:
        state.store.remove_file(file_id)
    except Exception as exc:
        if not is_store_failure(exc):
            raise
        raise store_unavailable(exc) from None
    state.db.remove_file(owner, file_id)
    return FileDeleted(id=file_id, deleted=True)
