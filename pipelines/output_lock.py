"""One run at a time per output location: the output lock.

A job holds `OUTPUT/_lock.json` from planning to its ledger; a second run on the same
output (a double-clicked schedule, a rerun started while the first still runs) is
refused at once with who holds the lock, before it reads or writes anything. Parts
of two runs can then never interleave, whatever their inputs.

    local disk     an exclusive `flock` on the file; the kernel drops it when the
                   holder exits or is killed, so a killed job never leaves a stale
                   lock and its rerun proceeds at once. The file names the holder
                   (run id, host, pid) for the refusal message and is removed on
                   release (a file left by a killed run is simply locked again).
    object stores  the lock object is created only if absent (S3 `If-None-Match: *`,
                   fsspec `mode="create"`), and its holder rewrites its heartbeat every
                   `HEARTBEAT_S`. A lock is stale - taken over with a warning - when
                   its heartbeat is older than `STALE_AFTER_S`, or its holder ran on
                   this host and its pid is gone (a killed job rerun on the same
                   machine proceeds at once). Two runs that find one stale lock at the
                   same moment can both take it over; that window is the length of a
                   delete and a create, after a holder has been silent for minutes.

The `_` prefix keeps the file out of anything that reads OUTPUT as a dataset.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.connectors.fs import display, is_local, redact_url, resolve
from tokenmill.connectors.store_retries import describe, is_store_error, store_operation

log = logging.getLogger(__name__)

LOCK_FILE = "_lock.json"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 180.0


class OutputLockedError(RuntimeError):
    """Another run holds the output's lock."""


class OutputLocationError(ValueError):
    """The output location cannot hold a job's results: a file is in the way, or the job
    may not write there. Raised before anything is read or computed."""


@dataclass
class LockHolder:
    """Who holds an output's lock (the lock file's content)."""

    run_id: str
    host: str
    pid: int
    started_at: float  # unix seconds
    heartbeat_at: float

    @classmethod
    def this_process(cls) -> LockHolder:
        now = time.time()
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(), now, now)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LockHolder | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None  # empty (being written) or not ours

    def is_stale(self, stale_after_s: float) -> bool:
        """Whether its holder is gone: dead on this host, or silent too long."""
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return True
        return time.time() - self.heartbeat_at > stale_after_s

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        return f"run {self.run_id[:12]} (pid {self.pid} on {self.host}, since {since})"


@contextlib.contextmanager
def output_lock(
    output: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    stale_after_s: float = STALE_AFTER_S,
    heartbeat_s: float = HEARTBEAT_S,
) -> Iterator[LockHolder]:
    """Hold the output's lock for the `with` block.

    Args:
        output: the job's output location.
        storage_options: filesystem options.
        stale_after_s: (object stores) a lock whose heartbeat is older is taken over.
        heartbeat_s: (object stores) how often the holder rewrites its heartbeat.

    Yields:
        This run's LockHolder.

    Raises:
        OutputLockedError: another live run holds the lock.
    """
    fs, path = resolve(output.rstrip("/") + "/" + LOCK_FILE, storage_options)
    directory = path.rsplit("/", 1)[0]
    if fs.isfile(directory):
        raise OutputLocationError(_file_in_the_way(output, redact_url(output)))
    holder = LockHolder.this_process()
    if is_local(fs):
        with _local_lock(path, holder, output):
            yield holder
    else:
        with _store_lock(fs, path, holder, output, stale_after_s, heartbeat_s):
            yield holder


@contextlib.contextmanager
def claimed_output(output: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """How every run starts (run_job, the flow): hold the output's lock, then remove the
    temporary files a killed run left behind - safe only under the lock, where no live
    run is writing them.

    Raises:
        OutputLockedError: another live run holds the lock.
    """
    from tokenmill.pipelines.output import remove_temp_files

    with output_lock(output, storage_options):
        removed = remove_temp_files(output, storage_options)
        if removed:
            log.info("removed %d temporary files left by a killed run", removed)
        yield


def _refusal(output: str, holder: LockHolder | None) -> OutputLockedError:
    who = holder.describe() if holder else "another run"
    return OutputLockedError(
        f"{redact_url(output)} is in use by {who}: two runs on one output would mix their "
        "results. Wait for that run to finish (rerunning then resumes the job), or use "
        "another output location."
    )


@contextlib.contextmanager
def _local_lock(path: str, holder: LockHolder, output: str) -> Iterator[None]:
    directory = os.path.dirname(path) or "."
    created = not os.path.isdir(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = _locked_fd(path, output)
    except (FileExistsError, NotADirectoryError):
        blocker = next(p for p in _ancestors(directory) if os.path.lexists(p))
        raise OutputLocationError(_file_in_the_way(output, blocker)) from None
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
            raise
        raise OutputLocationError(
            f"{output}: the job cannot write here ({exc.strerror}): choose an output "
            "location it may create and write, or grant it write access"
        ) from None
    try:
        os.ftruncate(fd, 0)  # a killed holder's file may still name it
        os.pwrite(fd, holder.to_bytes(), 0)
        yield
    finally:
        # Unlinked while still held: a run that opened the old file and locks it after
        # this close sees that its file is no longer the lock file, and retries.
        os.unlink(path)
        os.close(fd)
        if created:  # a run that failed before writing anything leaves no directory
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _ancestors(path: str) -> Iterator[str]:
    """`path`, then each directory above it."""
    path = os.path.abspath(path)
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _file_in_the_way(output: str, blocker: str) -> str:
    where = (
        "is an existing file"
        if blocker in (output, os.path.abspath(output))
        else (f"cannot be a directory: {blocker} is a file")
    )
    return (
        f"{output} {where}; the output is a directory of results: give a directory path "
        "(a new one is created), or move the file"
    )


def _locked_fd(path: str, output: str) -> int:
    """An open descriptor of the lock file at `path`, exclusively flock-ed."""
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _refusal(output, _read_local_lock(path)) from None
        try:
            is_current = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            is_current = False
        if is_current:
            return fd
        os.close(fd)  # locked a file its holder had just removed: take the new one
    raise _refusal(output, _read_local_lock(path))


def _read_local_lock(path: str) -> LockHolder | None:
    try:
        with open(path, "rb") as f:
            return LockHolder.from_bytes(f.read(4096))
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _store_lock(
    fs, path: str, holder: LockHolder, output: str, stale_after_s: float, heartbeat_s: float
) -> Iterator[None]:
    # A store that fails here (after its retry policy) fails the run before it starts,
    # with a StoreError that names the lock object rather than the client's raw error.
    with store_operation("taking the lock", display(fs, path)):
        _acquire_store_lock(fs, path, holder, output, stale_after_s)
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(fs, path, holder, stop, heartbeat_s), daemon=True
    )
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        _release_store_lock(fs, path, holder)


def _acquire_store_lock(
    fs, path: str, holder: LockHolder, output: str, stale_after_s: float
) -> None:
    """Create the lock object, taking over a stale one; raises OutputLockedError."""
    for _ in range(3):
        try:
            fs.pipe_file(path, holder.to_bytes(), mode="create")
            return
        except FileExistsError:
            current = _read_store_lock(fs, path)
            if current is not None and not current.is_stale(stale_after_s):
                raise _refusal(output, current) from None
            log.warning(
                "taking over the stale lock of %s on %s",
                current.describe() if current else "an unknown run",
                display(fs, path),
            )
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
    raise _refusal(output, _read_store_lock(fs, path))


def _release_store_lock(fs, path: str, holder: LockHolder) -> None:
    """Delete the lock if it is still ours. A store that fails here fails nothing: the
    run's work is done (or its own error is on its way, which this must not replace), and
    the lock, no longer refreshed, goes stale and is taken over by the next run."""
    try:
        current = _read_store_lock(fs, path)
        if current is not None and current.run_id == holder.run_id:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
    except Exception as exc:
        if not is_store_error(exc):
            raise
        log.warning(
            "could not release the lock on %s (%s); it goes stale and the next run takes it over",
            display(fs, path),
            describe(exc),
        )


def _heartbeat(fs, path: str, holder: LockHolder, stop: threading.Event, every_s: float) -> None:
    """Rewrite the lock's heartbeat every `every_s` until stopped. A beat the store fails
    (reading the lock or writing it) is logged and tried again at the next one: letting
    the error end this thread would stop the heartbeat for good, and the lock would go
    stale under a live run."""
    while not stop.wait(every_s):
        try:
            current = _read_store_lock(fs, path)
            if current is None or current.run_id != holder.run_id:
                log.error("the lock on %s was taken over by another run", display(fs, path))
                return
            holder.heartbeat_at = time.time()
            fs.pipe_file(path, holder.to_bytes())
        except Exception as exc:
            if not (isinstance(exc, OSError) or is_store_error(exc)):
                raise
            log.warning(
                "could not renew the lock on %s (%s); trying again at the next beat",
                display(fs, path),
                describe(exc),
            )


def _read_store_lock(fs, path: str) -> LockHolder | None:
    try:
        return LockHolder.from_bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
