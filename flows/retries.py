"""Which task failures are worth a retry.

Only I/O tasks retry, and only on errors that a second attempt can fix: a dropped
connection, a timeout, an object store's 5xx. Bad input (a missing file, a missing
column, duplicate ids - all ValueError) fails at once, so the flow run says what is
wrong instead of waiting through retries that cannot succeed.

Object-store errors are not retried here: every store request is already retried by
the one policy in `connectors/store_retries.py`, and a task retry on top would
multiply its attempts (and recompute a whole shard for one failed PUT).
"""

from __future__ import annotations

from typing import Any

from tokenmill.connectors.errors import DiskFullError
from tokenmill.connectors.store_retries import is_store_error

# OSErrors that describe the world, not a hiccup: retrying cannot change them.
_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    DiskFullError,  # a full disk stays full for a retry's few seconds; a rerun resumes
)
# Transport errors of HTTP stacks under fsspec (aiohttp, botocore, requests) that do
# not subclass OSError; matched by name so none of them has to be importable.
_TRANSIENT_NAME_PARTS = ("Timeout", "ConnectionError", "ConnectionClosed", "ServerDisconnected")

# One delay for every retry: Prefect's UI shows a task's retry delay as a number of
# seconds, and a list of delays there reads "NaNs". Jitter spreads retries of many
# shards hitting the same store.
NUM_RETRIES = 2
RETRY_DELAY_S = 5
RETRY_JITTER = 0.5


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` may go away on a retry (an object store's errors were retried already)."""
    if isinstance(exc, _PERMANENT_OS_ERRORS) or is_store_error(exc):
        return False
    if isinstance(exc, OSError):
        return True
    names = [cls.__name__ for cls in type(exc).__mro__]
    return any(part in name for name in names for part in _TRANSIENT_NAME_PARTS)


def _exception(state: Any) -> BaseException | None:
    try:
        value = state.result(raise_on_failure=False)
    except Exception as exc:  # the state could not give its result back: judge that error
        return exc
    return value if isinstance(value, BaseException) else None


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only transient I/O errors."""
    exc = _exception(state)
    return exc is not None and is_transient(exc)


def retry_shard(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn` for shard tasks.

    A shard's part appearing under it (FileExistsError: another run of the same job
    published it first) is retried too: the retry finds the part and skips the shard.
    """
    exc = _exception(state)
    return exc is not None and (isinstance(exc, FileExistsError) or is_transient(exc))
