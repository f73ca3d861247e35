"""The one retry policy for object-store requests, and the error that ends it.

Where S3 errors were retried before this module (measured through a fault-injecting
proxy, one `pipe` or `cat` of a small object, every request failing):

    botocore (legacy mode, 5 attempts per request)  x  s3fs's own loop (5 tries on
    timeouts and SlowDown)  x  Prefect task retries (3 tries of the whole task)

503 SlowDown on a PUT: 25 requests in 30 s per task try; a stalled server: 25 requests
of one read timeout each; both then tried twice more by Prefect. Nobody had chosen
those numbers, and a shard task's retry recomputed the whole shard for a failed PUT.

Now there is one place. `store_options` configures botocore's "standard" retry mode
for every request (`STORE_RETRY_POLICY.max_attempts` attempts in all, exponential
backoff with full jitter: a random wait below 1, 2, 4, 8 ... s, at most 20 s), which
retries 500/502/503/504, throttling (SlowDown), connection resets and connect/read
timeouts. s3fs's own loop is set to one try so the two never multiply, and an error
that comes out of the store after that is final: `StoreError`, which names the
operation, the object (credentials redacted) and the attempts, and which the flow's
task retries (`flows/retries.py`) do not retry again. A user's own `config_kwargs`
(or `retries`) in the storage options win over these defaults.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

S3_PROTOCOLS = frozenset({"s3", "s3a"})
# Errors that describe the object, not the transport: callers act on their type.
_SEMANTIC_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)
_STORE_MODULES = ("botocore", "aiobotocore", "s3fs", "aiohttp")
_USERINFO = re.compile(r"://[^/@\s\"']+@")


@dataclass(frozen=True)
class RetryPolicy:
    """How every object-store request is retried.

    Args:
        max_attempts: attempts per request in all (the first one included).
        connect_timeout_s: seconds to wait for a connection.
        read_timeout_s: seconds to wait for a response (a stalled server counts as a
            failed attempt after this long).
    """

    max_attempts: int = 5
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


STORE_RETRY_POLICY = RetryPolicy()


class StoreError(RuntimeError):
    """An object-store operation failed after the retry policy's last attempt."""


def store_options(
    protocol: str, storage_options: Mapping[str, Any] | None, policy: RetryPolicy | None = None
) -> dict[str, Any]:
    """The filesystem options for `protocol` with the retry policy filled in.

    Args:
        protocol: the URL's protocol (`s3`, `file`, ...); only S3 gets a policy.
        storage_options: the user's options; their `config_kwargs` keys and `retries` win.
        policy: defaults to `STORE_RETRY_POLICY`.

    Returns:
        A new dict (the user's mapping is not modified).
    """
    options = dict(storage_options or {})
    if protocol not in S3_PROTOCOLS:
        return options
    policy = policy or STORE_RETRY_POLICY
    config = {
        # botocore's `max_attempts` counts retries only; `total_max_attempts` counts all.
        "retries": {"mode": "standard", "total_max_attempts": policy.max_attempts},
        "connect_timeout": policy.connect_timeout_s,
        "read_timeout": policy.read_timeout_s,
        **dict(options.get("config_kwargs") or {}),
    }
    options["config_kwargs"] = config
    return options


def configure_filesystem(fs: Any) -> None:
    """Sets s3fs's own retry loop to one try, so that botocore's policy is the only one.

    (s3fs takes this as an attribute, not an option.) A response body cut off after
    botocore handed it over is the one case botocore cannot retry; s3fs's file reader
    re-requests that range itself.
    """
    if hasattr(fs, "retries") and type(fs).__module__.startswith("s3fs"):
        fs.retries = 1


def is_store_error(exc: BaseException) -> bool:
    """Whether `exc` came out of an object-store client (after its own retries)."""
    if isinstance(exc, StoreError):
        return True
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__module__.split(".", 1)[0] in _STORE_MODULES:
            return True
        exc = exc.__cause__
        seen += 1
    return False


@contextlib.contextmanager
def store_operation(operation: str, target: str) -> Iterator[None]:
    """Turns a transport failure of the store inside the block into a `StoreError`.

    Errors about the object itself (missing, exists, forbidden) pass through unchanged.

    Args:
        operation: what was being done, e.g. "writing" or "listing".
        target: the object or prefix, already redacted (`fs.display`).
    """
    try:
        yield
    except _SEMANTIC_ERRORS:
        raise
    except Exception as exc:
        if not is_store_error(exc):
            raise
        raise StoreError(f"{operation} {target} failed: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """A one-line account of a store failure: error code, API operation, attempts."""
    cause = exc
    while cause.__cause__ is not None and not hasattr(cause, "response"):
        cause = cause.__cause__
    response = getattr(cause, "response", None)
    if isinstance(response, Mapping) and "Error" in response:
        code = response["Error"].get("Code", "?")
        operation = getattr(cause, "operation_name", None) or "request"
        attempts = response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
        return f"{code} from the object store on {operation} after {attempts} attempt(s)"
    # Transport errors (reset, timeout): botocore's text names the endpoint URL, whose
    # user:password part (if any) is dropped; it carries no count, so give the budget.
    text = _USERINFO.sub("://***@", str(cause))
    return f"{type(cause).__name__}: {text} (after the retry policy's attempts)"
