"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llmcompressor_checkpoints(tmp_path_factory):
    """llm-compressor's data-free W4A16_ASYM, W8A8 and FP8_DYNAMIC checkpoints of one
    random Llama, rebuilt with compressed-tensors (reference_quantizers says how): scheme
    name -> model directory. Tests copy a directory before adding files to it."""
    from reference_quantizers import LLMCOMPRESSOR_SCHEMES, write_llmcompressor_checkpoint

    root = tmp_path_factory.mktemp("llmcompressor")
    return {s: write_llmcompressor_checkpoint(root / s, s) for s in LLMCOMPRESSOR_SCHEMES}
