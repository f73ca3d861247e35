"""keep_large_allocations_mapped: a step's freed activations are reused, not re-faulted."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# A step's activations, 40 times: the MLP's [2048, 2 * 5632] fp32 output of a 1B-class
# model (44 MiB) and the [2048, 5632] product of its halves, each dying a moment later.
# Above 32 MiB glibc never lets its adaptive threshold move such blocks to the heap, so
# untuned every step maps and faults them afresh, whatever ran before.
_PROBE = """
import json, resource
import torch
from tokenmill.engine.worker.host_memory import keep_large_allocations_mapped
applied = keep_large_allocations_mapped()
torch.set_num_threads(1)  # one malloc arena, so the count does not depend on scheduling
def step():
    gate_up = torch.ones(2048, 2 * 5632)
    gate, up = gate_up.split(5632, dim=-1)
    return (gate * up).sum()
for _ in range(3):  # the heap grows to the step's high-water mark
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

PAGES_PER_STEP = 4 * 2048 * (2 * 5632 + 5632) // 4096


def _probe(tune: bool) -> dict:
    env = {**os.environ, "TOKENMILL_TUNE_MALLOC": "1" if tune else "0"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the tuning is glibc malloc's",
)
def test_freed_activations_are_reused_instead_of_faulted_again():
    untuned = _probe(tune=False)
    tuned = _probe(tune=True)
    assert untuned["applied"] is False
    assert tuned["applied"] is True
    # Untuned, glibc maps and unmaps these blocks each time: every step faults them in.
    assert untuned["faults"] > 30 * PAGES_PER_STEP, (tuned, untuned)
    # Tuned, the blocks stay in the heap: all 40 steps together fault a few steps' pages
    # at most (measured 0.7-1.3 steps' worth: this VM's proactive reclaim takes back
    # idle heap pages now and then), against 40 steps' worth untuned.
    assert tuned["faults"] < 5 * PAGES_PER_STEP, (tuned, untuned)


# A 256 MiB KV-cache-like buffer: where the kernel can be asked for huge pages, at least
# some of its range must come back backed by them (smaps' AnonHugePages for its mapping),
# and no page of it may be committed before it is touched.
_HUGE_PROBE = """
import json, sys, torch
from tokenmill.engine.worker.host_memory import HUGE_PAGE_BYTES, asks_for_huge_pages, lazy_zeros
def mapping_kb(t, field):
    # one smaps field (Rss, AnonHugePages) of the mapping that holds t: the process's
    # RSS would also count whatever torch allocates on the side
    start, total, inside = t.data_ptr(), 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == field + ":":
            total += int(line.split()[1])
    return total
huge = sys.argv[1] == "1"
t = lazy_zeros((128, 1024, 1024), torch.int16, huge_pages=huge)
committed_kb = mapping_kb(t, "Rss")
t[::2].fill_(0)  # touch half the pages, as a cache's first blocks are written
print(json.dumps({"asked": huge and asks_for_huge_pages(),
                  "aligned": t.data_ptr() % HUGE_PAGE_BYTES == 0,
                  "zeros": bool((t == 0).all()), "shape": list(t.shape),
                  "committed_kb": committed_kb, "huge_kb": mapping_kb(t, "AnonHugePages")}))
"""


def _huge_probe(enabled: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _HUGE_PROBE, "1" if enabled else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return "[never]"


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
def test_kv_cache_buffers_are_zeroed_lazily_and_backed_by_huge_pages_where_the_kernel_allows():
    on, off = _huge_probe(enabled=True), _huge_probe(enabled=False)
    for probe in (on, off):
        assert probe["zeros"] and probe["shape"] == [128, 1024, 1024], probe
        # 256 MiB asked for, nothing committed until touched.
        assert probe["committed_kb"] < 4096, probe
    assert off["asked"] is False
    if "[never]" in _thp_mode():
        assert on["asked"] is False and on["huge_kb"] == 0, on
        return
    # Asked before the first touch, the 2 MiB-aligned range faults in as huge pages.
    assert on["asked"] and on["aligned"], on
    assert on["huge_kb"] >= 2048, on
    if "[always]" not in _thp_mode():  # "madvise": only what was asked for
        assert off["huge_kb"] == 0, (on, off)
