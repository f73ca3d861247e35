"""fsspec URL resolution and the redaction every user-facing message goes through."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol, infer_compression

from tokenmill.connectors.errors import SourceError
from tokenmill.connectors.log_redaction import remember_credentials
from tokenmill.connectors.store_retries import configure_filesystem, store_options

# Object stores (and the in-memory filesystem) make a single upload visible all at once,
# so writing the final key directly is already atomic there.
SINGLE_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "memory"})

# Option keys whose values are safe to show; everything else is redacted.
_SAFE_OPTION_KEYS = frozenset({"endpoint_url", "region_name", "anon", "use_ssl", "project"})


def resolve(uri: str, storage_options: Mapping[str, Any] | None = None):
    """Turns a URL or local path into an fsspec filesystem and a path on it.

    Args:
        uri: any fsspec URL (`s3://b/k`, `memory://x`, `file:///p`) or a local path.
        storage_options: keyword arguments for the filesystem (credentials, endpoint).

    Returns:
        `(fs, path)`; raises `SourceError` for an unknown or unavailable protocol.
        Object stores get the one retry policy (`store_retries.store_options`).
    """
    _check_userinfo(uri)
    remember_credentials(storage_options)  # libraries log them at DEBUG; see log_redaction
    options = store_options(get_protocol(uri), storage_options)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except ImportError as e:
        # fsspec's message names the missing package, never the options.
        raise SourceError(f"{redact_url(uri)}: this protocol needs an extra package ({e})") from e
    except (ValueError, TypeError) as e:
        # A bad option name is reported by name only; option values never reach here.
        raise SourceError(f"{redact_url(uri)}: cannot open this URL ({e})") from e
    configure_filesystem(fs)
    return fs, path


def _check_userinfo(uri: str) -> None:
    """Refuse credentials written into an object-store URL; remember an HTTP password.

    `s3://KEY:SECRET@bucket/...` is not a form any object store understands: the
    secret would end up in a bucket name, and from there in the client's errors.
    """
    parts = urlsplit(uri)
    if "://" not in uri or "@" not in parts.netloc:
        return
    user, _, _ = parts.netloc.rpartition("@")
    name, _, password = user.partition(":")
    remember_credentials({"key": name, "password": password})
    if parts.scheme not in ("http", "https"):
        raise SourceError(
            f"{redact_url(uri)}: credentials in the URL are not supported; give them as "
            "storage options (key/secret, a Prefect storage_secret or the environment)"
        )


def protocol_of(fs) -> str:
    """The filesystem's primary protocol name, e.g. `s3`, `file`, `memory`."""
    proto = fs.protocol
    return proto if isinstance(proto, str) else proto[0]


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def to_url(fs, path: str) -> str:
    """The URL a path on `fs` can be reopened with; plain local paths stay plain."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def display(fs, path: str) -> str:
    """How a file is named in errors: its URL without any embedded secret."""
    return redact_url(to_url(fs, path))


def redact_url(uri: str) -> str:
    """Drops passwords and query strings (presigned URLs carry signatures there)."""
    parts = urlsplit(uri)
    if not parts.scheme or "://" not in uri:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"
    query = "<redacted>" if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def redact_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of the options safe to show: only known-harmless keys keep their values."""
    return {k: (v if k in _SAFE_OPTION_KEYS else "***") for k, v in (storage_options or {}).items()}


# Remote files read ahead one block; s3fs defaults to 50 MiB, far more than a schema
# sample needs and more memory per open stream than a batch does.
HEAD_BLOCK_BYTES = 2 << 20
STREAM_BLOCK_BYTES = 8 << 20


def open_text_stream(fs, path: str, *, head: bool = False):
    """Opens a file for sequential reading, decompressing by its suffix (`.gz`, `.zst`...).

    Args:
        fs: the fsspec filesystem.
        path: the file.
        head: only the first block will be read (schema inference, validation).
    """
    block_size = HEAD_BLOCK_BYTES if head else STREAM_BLOCK_BYTES
    return fs.open(path, "rb", block_size=block_size, compression=infer_compression(path))


def is_hidden(relative_path: str) -> bool:
    """True for `_SUCCESS`, `.tmp` files and anything under a `_`/`.` directory."""
    return any(p.startswith(("_", ".")) for p in relative_path.split("/") if p)


def relative_to(root: str, path: str) -> str:
    root = root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return posixpath.basename(path)
