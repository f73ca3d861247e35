"""Loading the native kernels leaves the process's floating-point state alone."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import torch
from tokenmill.engine.kernels import native_library
tiny = torch.tensor([1e-39])  # a float32 denormal
assert (tiny * 0.5).item() > 0, "denormals flushed before loading"
assert native_library() is not None, "the kernels did not build"
print((tiny * 0.5).item())
"""


def test_loading_the_library_keeps_denormals(tmp_path):
    """Built with -ffast-math at link time, GCC adds a constructor that switches on
    flush-to-zero for the whole process: every float op of the user's, in torch or
    numpy, would then round denormals to zero."""
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path)}  # a fresh build
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) > 0, "loading the kernels flushed denormals to zero"
