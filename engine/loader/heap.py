"""Giving the heap's freed memory back to the system during a load.

Building a quantized layer makes temporaries of a few bytes a weight (codes widened to
int16 and int32, a fused layer's parts joined) that live for that layer only. glibc's
malloc serves allocations that large with mmap at first, but raises that threshold to
each size it frees, so later ones come from its heap - and a freed stretch of heap below
a live one stays in the process: a W4A16 SmolLM2 ended its load tens of MB above its
weights, all of it free memory malloc kept (RssAnon, which a load is held to).
malloc_trim returns every free page of the heaps; called after each layer it keeps the
load's peak at the weights plus one layer's temporaries, for a few milliseconds a call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def return_freed_heap() -> None:
    """Give the heap's free pages back to the system (a no-op without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
