"""keep_large_allocations_mapped: a step's freed activations are reused, not re-faulted."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# One decoder layer's elementwise work over a 1,900-token step, done 40 times: every op
# returns a fresh activation of 1-12 MiB that dies a moment later.
_PROBE = """
import json, resource
import torch
from torch.nn import functional as F
from tokenmill.engine.host_memory import keep_large_allocations_mapped
applied = keep_large_allocations_mapped()
# One thread: worker threads allocate from their own malloc arenas, each warming up on
# its own schedule, which would make the count depend on how the work was split.
torch.set_num_threads(1)
x = torch.randn(1900, 576)
w = torch.randn(576)
gate_up = torch.randn(1900, 3072)
def step():
    h = x + F.rms_norm(x, (576,), w, 1e-5)
    gate, up = gate_up.split(1536, dim=-1)
    return (F.silu(gate) * up).sum() + h.sum()
for _ in range(10):  # the heap grows to the step's high-water mark
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

# The step's activations: two [1900, 576] and two [1900, 1536] fp32 tensors.
PAGES_PER_STEP = 4 * 1900 * (576 + 1536) // 4096


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
    # Untuned, glibc maps and unmaps these blocks each time: steps fault most pages.
    assert untuned["faults"] > 10 * PAGES_PER_STEP
    # Tuned, the blocks stay in the heap: all 40 steps together fault less than two
    # steps' pages (measured: 0-4,631 tuned, 63,092-226,760 untuned; the tuned tail is
    # the heap settling after a fragmentation, once).
    assert tuned["faults"] < 2 * PAGES_PER_STEP, (tuned, untuned)
