"""Credentials given as storage options never reach a log record, whoever logs it.

tokenmill's own messages never include option values, but the libraries under fsspec
do at DEBUG: botocore logs every canonical request it signs, session token included,
and the Authorization header with the access key id. Any handler (stderr, a file,
Prefect's API log handler) may be listening. So the values of credential options
are remembered when a filesystem is made from them (`remember_credentials`, called
by `fs.resolve`), and a log record factory replaces them with `***` in every record
as it is created - before any handler or formatter sees it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

REDACTED = "***"
# Option names that hold credentials, in s3fs, gcsfs, adlfs and polars spellings.
CREDENTIAL_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "session_token",
        "access_key",
        "secret_key",
        "account_key",
        "sas_token",
        "client_secret",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "connection_string",
    }
)
# Shorter values would redact ordinary words; no real credential is this short.
_MIN_SECRET_CHARS = 6

_secrets: set[str] = set()
_lock = threading.Lock()
_installed = False


def remember_credentials(storage_options: Mapping[str, Any] | None) -> None:
    """Remember the credential values in `storage_options` (nested ones too) for redaction."""
    found = set(_credential_values(storage_options or {}))
    if not found - _secrets:
        return
    with _lock:
        _secrets.update(found)
        _install()


def redact(text: str) -> str:
    """`text` with every remembered credential replaced by `***`."""
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: no partial hits
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _credential_values(options: Mapping[str, Any]):
    for name, value in options.items():
        if isinstance(value, Mapping):
            yield from _credential_values(value)
        elif (
            isinstance(value, str)
            and name.lower() in CREDENTIAL_KEYS
            and len(value) >= _MIN_SECRET_CHARS
        ):
            yield value


def _install() -> None:
    global _installed
    if _installed:
        return
    make_record = logging.getLogRecordFactory()

    def redacting_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: the handler will report it as usual
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(redacting_record)
    _installed = True
