"""A model's files in and out of the page cache: what a cold start is made and checked with.

`drop_from_page_cache` writes back and drops every page of the files
(`posix_fadvise(POSIX_FADV_DONTNEED)`); `resident_share` says, through `mincore`, which
share of their pages the page cache still holds - not 0 after a drop where another
process keeps them mapped, or on a filesystem that lives in memory (tmpfs). Linux only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import subprocess
from pathlib import Path


def model_files(path: Path) -> list[Path]:
    """Every regular file of a model (a directory's, symlinks resolved; or the file)."""
    if path.is_file():
        return [path.resolve()]
    files = {p.resolve() for p in path.rglob("*") if p.is_file()}
    return sorted(files)


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are not dropped: written back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_share(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore on a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = -(-size // mmap.PAGESIZE)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                resident += sum(b & 1 for b in vec.raw)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def disk_read_speed(path: Path) -> float:
    """Bytes a second `dd` reads `path` at, after dropping it from the page cache."""
    drop_from_page_cache([path])
    done = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, text=True, check=True
    )
    # "N bytes (...) copied, S s, ..." - the seconds as dd measured them.
    match = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"dd printed no speed: {done.stderr.strip()[-200:]}")
    return int(match.group(1)) / float(match.group(2))
