"""The staged windows' removal while a part of an earlier planning still writes there."""

from __future__ import annotations

import errno
import os

import pytest
from fsspec.implementations.local import LocalFileSystem

from tokenmill.pipelines import output as out


def _staging(tmp_path):
    staging = tmp_path / "out" / out.WINDOWS_DIR
    staging.mkdir(parents=True)
    (staging / "0-0.parquet").write_bytes(b"x")
    return staging


def _late_writer(monkeypatch, landings: int) -> list[int]:
    """LocalFileSystem.rm, with a file staged inside the directory as it is removed the
    first `landings` times (what a part still running does)."""
    real_rm, calls = LocalFileSystem.rm, []

    def rm(self, path, recursive=False, maxdepth=None):
        calls.append(1)
        if len(calls) <= landings:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"late-{len(calls)}.parquet"), "wb") as f:
                f.write(b"x")
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        return real_rm(self, path, recursive=recursive, maxdepth=maxdepth)

    monkeypatch.setattr(LocalFileSystem, "rm", rm)
    return calls


def test_a_file_landing_during_the_removal_is_removed_on_the_next_round(tmp_path, monkeypatch):
    staging = _staging(tmp_path)
    calls = _late_writer(monkeypatch, landings=2)
    out.remove_staged_windows(str(tmp_path / "out"))
    assert not staging.exists() and len(calls) == 3


def test_a_writer_that_never_stops_fails_the_removal_by_name(tmp_path, monkeypatch):
    _staging(tmp_path)
    calls = _late_writer(monkeypatch, landings=out.STAGING_REMOVALS)
    with pytest.raises(OSError, match="not empty"):
        out.remove_staged_windows(str(tmp_path / "out"))
    assert len(calls) == out.STAGING_REMOVALS
