"""Keep the pages of large CPU temporaries mapped between steps.

Every CPU forward pass allocates activations of a few to a few hundred megabytes
(a 2,048-token step's MLP output is [2048, 2 * intermediate]) and frees them a moment
later. glibc's malloc serves blocks that size with a fresh mmap and returns them
with munmap, so each step pays a page fault, and the kernel zeroes a page, for every
4 KiB it touches - more, on the mixed64 benchmark, than its norms, rotary and residuals
cost together (docs/design.md, "Page faults").

`keep_large_allocations_mapped` raises malloc's mmap threshold so those blocks come
from the heap, and its trim threshold so the heap is not shrunk after each step; the
freed blocks are reused by the next step instead. The cost is that the process keeps
its peak activation memory resident until it exits, which for an inference process
running step after step it needs again anyway. Set TOKENMILL_TUNE_MALLOC=0 to leave
malloc alone (e.g. when the process preloads jemalloc or tcmalloc; engine/env.py).

`lazy_zeros` is for the other end: buffers allocated once and streamed every step (the
KV cache). They come from an anonymous mapping of their own, which the kernel fills
with zero pages only as they are first touched: a cache sized for the longest job costs
no time and no memory until its blocks are used, and a block never read before it is
written holds zeros, never NaNs. A decode step reads a sequence's blocks in 2-4 KiB runs
scattered over gigabytes, so with 4 KiB pages nearly every run needs a page walk the TLB
has no room for - dearer still in a virtual machine, where each walk also walks the
host's tables. Linux backs memory with 2 MiB pages only where asked (transparent_hugepage
"madvise", the common default); `huge_pages=True` asks, for those buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import platform
import threading
from pathlib import Path

import torch

from tokenmill.engine import env

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_MADV_HUGEPAGE = 14  # <sys/mman.h>
HUGE_PAGE_BYTES = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Blocks below this come from the heap. Above it (the KV cache, weights) mmap is
# right: they are allocated once and live as long as the engine.
MMAP_THRESHOLD_BYTES = 256 << 20
# Free memory at the top of the heap beyond this is returned to the system.
TRIM_THRESHOLD_BYTES = 1 << 30

_lock = threading.Lock()
_applied: bool | None = None


def keep_large_allocations_mapped() -> bool:
    """Tune glibc malloc for step-after-step inference; once per process.

    Returns:
        True when the settings are in effect (glibc, not disabled by the environment).
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if not env.TUNE_MALLOC.is_on():
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused the thresholds; malloc left as it was")
    return ok


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, huge_pages: bool) -> torch.Tensor:
    """A zeroed CPU tensor on an anonymous mapping of its own: no page is committed (or
    zeroed) until it is first touched. With huge_pages, the kernel is asked to back it
    with 2 MiB pages (madvise MADV_HUGEPAGE before the first touch) where it can be asked.

    The tensor is a 2 MiB-aligned view into a mapping one huge page larger, so the pages
    it covers are whole huge pages. The mapping lives as long as the tensor.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    if huge_pages and asks_for_huge_pages():
        span = nbytes - nbytes % HUGE_PAGE_BYTES
        if span and _madvise()(raw.data_ptr() + start, span, _MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused; 4 KiB pages (errno %d)", ctypes.get_errno())
    return raw[start : start + nbytes].view(dtype).view(shape)


def asks_for_huge_pages() -> bool:
    """Whether 2 MiB pages can be asked for here (Linux, transparent huge pages not off)."""
    return _madvise() is not None


@functools.cache
def _madvise():
    """libc's madvise where transparent huge pages can be asked for, else None."""
    if platform.system() != "Linux":
        return None
    try:
        mode = _THP_MODE.read_text()
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    if "[never]" in mode:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
