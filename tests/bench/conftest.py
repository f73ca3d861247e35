"""Fixtures for the benchmark tests: a tiny model directory with room for the smoke preset."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bench-model"), max_position_embeddings=512)
