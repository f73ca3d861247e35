"""The API's requests and responses as pydantic models, field for field OpenAI's (the
`openai` package's `Batch`, `FileObject`, `Model` and list types parse them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.batch_api.settings import COMPLETION_WINDOW

BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
# A batch in one of these has finished: nothing more will change.
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
# OpenAI's limits on metadata.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)


class BatchCreate(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("endpoint")
    @classmethod
    def _served_endpoint(cls, value: str) -> str:
        if value not in ENDPOINTS:
            raise ValueError(f"must be one of {', '.join(ENDPOINTS)} (the endpoints served)")
        return value

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        if value != COMPLETION_WINDOW:
            raise ValueError(f"must be {COMPLETION_WINDOW!r}, as OpenAI's API takes it")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > METADATA_KEYS:
            raise ValueError(f"at most {METADATA_KEYS} keys")
        for key, text in value.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters")
            if len(text) > METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {METADATA_VALUE_CHARS} characters")
        return value


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class CursorPage(BaseModel):
    """A page of a cursor-paginated list: the client's next `after` is `last_id`."""

    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool

    @classmethod
    def of(cls, data: list, has_more: bool):
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )


class FileList(CursorPage):
    data: list[FileObject]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None = None


class BatchList(CursorPage):
    data: list[Batch]


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
