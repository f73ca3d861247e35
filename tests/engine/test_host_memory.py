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
from tokenmill.engine.host_memory import keep_large_allocations_mapped
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
