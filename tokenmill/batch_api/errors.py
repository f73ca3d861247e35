"""Errors in OpenAI's shape - `{"error": {"message", "type", "param", "code"}}` - with the
status codes the `openai` client turns into its usual exception classes (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409 ConflictError, 413 and
422 as APIStatusError, 429 RateLimitError, 503 InternalServerError)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.connectors.store_retries import is_store_error

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error the API answers with; its message must never hold a request body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type,
            code,
            param,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def not_found(kind: str, object_id: str) -> APIError:
    # The id is echoed only when it has our shape; anything else may be hostile text.
    return APIError(404, f"No such {kind}: {object_id}", code="not_found")


def store_unavailable(exc: BaseException) -> APIError:
    return APIError(
        503,
        f"the store is unavailable ({type(exc).__name__}); nothing was changed: try again later",
        type="server_error",
        code="store_unavailable",
    )


def is_store_failure(exc: BaseException) -> bool:
    """Whether `exc` is the store failing (local disk or an object store after its
    retries), not a request's fault: answered 503, tried again later."""
    return isinstance(exc, OSError) or is_store_error(exc)


def install_error_handlers(app: FastAPI) -> None:
    """One handler per kind of failure, all answering in OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Name the field and what is wrong; never echo the value (it may be large or private).
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
        message = f"{where or 'request'}: {first.get('msg', 'invalid request')}"
        error = APIError(400, message, param=where or None, code="invalid_value")
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        error = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if is_store_failure(exc):  # wherever the store failed, the answer is the same
            error = store_unavailable(exc)
            return JSONResponse(error.body(), status_code=error.status)
        # The traceback names code, not request bodies; the answer names only the type.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        error = APIError(500, f"internal error ({type(exc).__name__})", type="server_error")
        return JSONResponse(error.body(), status_code=500)
