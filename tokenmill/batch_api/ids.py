"""Object ids: made here, and checked before they reach the database or a path.

An id the server did not make - another shape, `../`, a NUL, a URL - is answered 404 at
the router, so only ids of exactly these shapes ever name a row or a file on the store.
"""

from __future__ import annotations

import re
import secrets

FILE_PREFIX, BATCH_PREFIX = "file-", "batch_"
_SHAPES = {
    FILE_PREFIX: re.compile(r"file-[0-9a-f]{24}"),
    BATCH_PREFIX: re.compile(r"batch_[0-9a-f]{32}"),
}


def new_file_id() -> str:
    return FILE_PREFIX + secrets.token_hex(12)


def new_batch_id() -> str:
    return BATCH_PREFIX + secrets.token_hex(16)


def is_file_id(value: str) -> bool:
    return _SHAPES[FILE_PREFIX].fullmatch(value) is not None


def is_batch_id(value: str) -> bool:
    return _SHAPES[BATCH_PREFIX].fullmatch(value) is not None
