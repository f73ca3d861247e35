"""API keys as bearer tokens: a dependency that names the caller's owner id, or refuses.

Each key is its own owner: it sees only the files and batches it made, and any other
id - another key's included - is answered as not found. A key is never stored or
logged; objects record a digest of it (`settings.owner_of`).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from tokenmill.batch_api.errors import APIError
from tokenmill.batch_api.jobs import ServerState
from tokenmill.batch_api.settings import ANONYMOUS, owner_of


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def caller(request: Request) -> str:
    """The owner id of the request's API key (`Authorization: Bearer KEY`).

    Raises:
        APIError: 401 without a key, or with one the server does not know.
    """
    settings = request.app.state.server.settings
    if settings.no_auth:
        return ANONYMOUS
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(
            401,
            "no API key: send it as Authorization: Bearer KEY",
            type="invalid_request_error",
            code="missing_api_key",
        )
    # Compared with every key, each in constant time: no early exit tells a prefix apart.
    matches = [hmac.compare_digest(key.encode(), known.encode()) for known in settings.api_keys]
    if not any(matches):
        raise APIError(
            401, "the API key is not valid", type="invalid_request_error", code="invalid_api_key"
        )
    return owner_of(key)
