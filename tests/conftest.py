"""Suite-wide settings.

Without a GPU, Triton kernels (the engine's CUDA path) run in Triton's interpreter on CPU
tensors. The interpreter must be chosen before anything imports triton - transformers and
torch may import it while the suite runs - so it is set here, once, for the session.

Tests of a CPU-specific fast path check the fast path where this CPU has it and the
fallback where it has not; they record which one ran with the `cpu_path` fixture, and
the run ends with that list, so a log from an AVX2-only machine says what it tested.

Every test starts from the same random state, so a test drawing from the global
generators draws the same numbers whatever ran before it, and a failure reproduces alone.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CPU_PATHS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _seeded():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def cpu_path():
    """`cpu_path(feature, path)` records which implementation of `feature` this CPU ran."""

    def record(feature: str, path: str) -> None:
        _CPU_PATHS[feature] = path

    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if _CPU_PATHS:
        terminalreporter.section("CPU paths tested")
        for feature, path in sorted(_CPU_PATHS.items()):
            terminalreporter.write_line(f"{feature}: {path}")
