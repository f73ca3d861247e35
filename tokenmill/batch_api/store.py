"""Where files and each batch's work live, on local disk or any fsspec store.

    STORE/files/<file id>.jsonl      uploaded inputs, and the output and error files
    STORE/batches/<batch id>/        the batch's job output: results parts, plan files,
                                     results.jsonl, ledger.json (`pipelines/output.py`)
    STORE/ledger/                    every batch's ledger row (the job's ledger dataset)
    STORE/batch-api.sqlite3          the state database, for a local store by default

Paths are built from ids the server made (`ids.py`), never from what a request says.
A file reaches the store complete or not at all: from a local spool file, by a rename
on local disk or by one upload (multipart, streamed from disk) on an object store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

from tokenmill.connectors.atomic import atomic_file
from tokenmill.connectors.fs import is_local, resolve, to_url
from tokenmill.connectors.store_retries import store_operation
from tokenmill.pipelines.output import join

CHUNK_BYTES = 1 << 20


class Store:
    """The store's files and batch directories."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root
        self.storage_options = storage_options
        self.fs, self._path = resolve(root, storage_options)
        if is_local(self.fs):
            os.makedirs(self._path, exist_ok=True)

    # -- locations --------------------------------------------------------------------

    def file_path(self, file_id: str) -> str:
        return join(self._path, "files", f"{file_id}.jsonl")

    def file_url(self, file_id: str) -> str:
        """The file as a job reads it (its input)."""
        return to_url(self.fs, self.file_path(file_id))

    def batch_url(self, batch_id: str) -> str:
        """The batch's job output directory."""
        return to_url(self.fs, join(self._path, "batches", batch_id))

    @property
    def ledger_url(self) -> str:
        return to_url(self.fs, join(self._path, "ledger"))

    # -- files --------------------------------------------------------------------------

    def put_file(self, file_id: str, local_path: str, *, overwrite: bool = False) -> None:
        """Publish a spooled local file as the store file `file_id`."""
        path = self.file_path(file_id)
        if is_local(self.fs):
            with (
                open(local_path, "rb") as src,
                atomic_file(self.fs, path, overwrite=overwrite) as dst,
            ):
                shutil.copyfileobj(src, dst, CHUNK_BYTES)
            return
        with store_operation("writing", path):
            self.fs.put_file(local_path, path)

    @contextlib.contextmanager
    def open_file(self, file_id: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.file_path(file_id), "rb", block_size=CHUNK_BYTES * 8) as f:
            yield f

    def iter_file(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes in chunks (a download is streamed, never held whole)."""
        with self.open_file(file_id) as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    def file_exists(self, file_id: str) -> bool:
        return self.fs.exists(self.file_path(file_id))

    def remove_file(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.file_path(file_id))

    def remove_batch_work(self, batch_id: str) -> None:
        path = join(self._path, "batches", batch_id)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


@contextlib.contextmanager
def spool_file(directory: str | None) -> Iterator[tuple[BinaryIO, str]]:
    """A temporary local file (the upload spool), removed when the block ends, whatever
    happens in it."""
    fd, path = tempfile.mkstemp(prefix="tokenmill-upload-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f, path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
