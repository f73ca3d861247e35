"""A cold start's page cache: the files' pages dropped, and mincore's count of what is
left, checked against the pages a read brings in and against util-linux's fincore."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tokenmill.bench.page_cache import drop_from_page_cache, model_files, resident_share

PAGE = os.sysconf("SC_PAGE_SIZE")
TMPFS_MAGIC = 0x01021994


def _in_memory_fs(path) -> bool:
    """tmpfs keeps its files in the page cache: nothing there can be dropped."""
    out = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True)
    return out.returncode == 0 and int(out.stdout.strip(), 16) == TMPFS_MAGIC


def test_dropped_pages_leave_and_a_read_of_half_brings_half_back(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    big = model / "sub" / "weights.bin"
    big.write_bytes(os.urandom(256 * PAGE))
    (model / "config.json").write_text("{}")
    (model / "link.bin").symlink_to(big)
    files = model_files(model)
    assert files == sorted([big.resolve(), (model / "config.json").resolve()])
    assert resident_share([big]) == 1.0  # just written

    drop_from_page_cache(files)  # dirty: written back, then dropped
    if _in_memory_fs(big):
        assert resident_share([big]) == 1.0  # said as it is: nothing left
        return
    assert resident_share([big]) == 0.0
    with open(big, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead
        f.read(128 * PAGE)
    assert resident_share([big]) == pytest.approx(0.5, abs=0.05)
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", str(big)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(out.stdout.split()[0]) == round(resident_share([big]) * 256) * PAGE
