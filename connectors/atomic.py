"""Writing one file so that readers see all of it or nothing, on any fsspec filesystem."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

from tokenmill.connectors.errors import DiskFullError
from tokenmill.connectors.fs import SINGLE_PUT_PROTOCOLS, display, is_local, protocol_of
from tokenmill.connectors.store_retries import store_operation
from tokenmill.faults import fault_point

# Errors that mean "the disk is full" (a quota counts), whichever filesystem says it.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# Temp files start with "." (hidden from listings and sources) and carry this marker.
TEMP_MARKER = ".tmp-"


def temp_path(path: str) -> str:
    """A unique hidden sibling of `path` to write into before the final rename."""
    parent, name = posixpath.split(path)
    return posixpath.join(parent, f".{name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARKER in name


def atomic_write(fs, path: str, write: Callable[[BinaryIO], None], *, overwrite: bool) -> None:
    """Writes `path` through `write(fileobj)` so that it appears complete or not at all.

    Args:
        fs: the fsspec filesystem.
        path: the final path on `fs`.
        write: serializes the content into a binary file object.
        overwrite: replace an existing file; otherwise raise `FileExistsError`.
    """
    with atomic_file(fs, path, overwrite=overwrite) as f:
        write(f)


@contextlib.contextmanager
def atomic_file(fs, path: str, *, overwrite: bool) -> Iterator[BinaryIO]:
    """A binary file to write in a `with` block: it appears at `path` complete when the
    block ends, and not at all when the block raises.

    Local disk: temp file in the same directory, fsync, then a rename (a hard link when
    not overwriting, which refuses to replace an existing file). Object stores: one
    upload of the final key, which S3/GCS/Azure publish atomically. Others: temp file
    plus `fs.mv`.

    Args:
        fs: the fsspec filesystem.
        path: the final path on `fs`.
        overwrite: replace an existing file; otherwise raise `FileExistsError`.

    Raises:
        DiskFullError: the filesystem ran out of space; nothing was published.
    """
    try:
        with _atomic_file(fs, path, overwrite=overwrite) as f:
            yield f
    except OSError as exc:
        if exc.errno not in _FULL_ERRNOS or isinstance(exc, DiskFullError):
            raise
        raise DiskFullError(
            exc.errno,
            f"no space left on the output's filesystem while writing {display(fs, path)}; "
            "nothing half-written was kept. Free some space (or choose another output "
            "location) and rerun the same command: the job resumes from its completed shards",
        ) from exc


@contextlib.contextmanager
def _atomic_file(fs, path: str, *, overwrite: bool) -> Iterator[BinaryIO]:
    if is_local(fs):
        with _local_file(path, overwrite=overwrite) as f:
            yield f
        return
    if not overwrite:
        _refuse_existing(fs, path)
    if protocol_of(fs) in SINGLE_PUT_PROTOCOLS:
        # The whole object is built in memory first: a failed block uploads nothing.
        buffer = io.BytesIO()
        yield buffer
        fault_point("write", path)
        with store_operation("writing", display(fs, path)):
            fs.pipe_file(path, buffer.getvalue())
        return
    tmp = temp_path(path)
    try:
        with fs.open(tmp, "wb") as f:
            yield f
            fault_point("write", path)
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise


def _refuse_existing(fs, path: str) -> None:
    # Listings are cached per filesystem instance; another writer may have added the file.
    fs.invalidate_cache(posixpath.dirname(path))
    with store_operation("checking", display(fs, path)):
        exists = fs.exists(path)
    if exists:
        raise FileExistsError(f"{display(fs, path)} already exists")


@contextlib.contextmanager
def _local_file(path: str, *, overwrite: bool) -> Iterator[BinaryIO]:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            fault_point("write", path)  # a kill here leaves a temp file behind
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_no_clobber(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is on disk.
    _fsync_dir(parent)


def _publish_no_clobber(tmp: str, path: str) -> None:
    # link() fails if `path` exists, so two writers can never both publish one name.
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists") from None
    except OSError:
        # Filesystems without hard links: check, then rename (a small race).
        if os.path.exists(path):
            raise FileExistsError(f"{path} already exists") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
