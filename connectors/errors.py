"""Errors raised by connectors."""

from __future__ import annotations

import re


class SourceError(ValueError):
    """An input dataset cannot be read as asked: raised before any row reaches compute.

    The message always names the file or URL (credentials redacted) and the problem.
    """


def access_denied(name: str) -> str:
    """The message for an input the job may not read (EACCES, an object store's 403)."""
    return (
        f"{name}: access denied - the job may not read it: grant read access (or "
        "give credentials that have it), or copy the data where the job can read it"
    )


class FileFormatError(ValueError):
    """Bytes that break a file's format as a whole, not one row's (an array that is not
    closed, an object where rows were expected): the file cannot be read on. The message
    says where and what, never quoting the file's content."""


def safe_arrow_message(message: str) -> str:
    """pyarrow's parse errors quote the offending cell or row; keep everything else."""
    message = re.sub(r"invalid value '.*'", "invalid value", message, flags=re.S)
    message = re.sub(
        r"Could not convert .* with type",
        "Could not convert a value with type",
        message,
        flags=re.S,
    )
    return re.sub(r"(Expected \d+ columns, got \d+):.*", r"\1", message, flags=re.S)


class DiskFullError(OSError):
    """The output's filesystem ran out of space (or quota) while a file was written.

    Nothing half-written is left: the file's temporary copy is removed, and files
    already published stay complete, so rerunning the same job once space is freed
    resumes it. `errno` is the original ENOSPC or EDQUOT.
    """
