"""Checkpoints quantized by other tools, read in their own formats: config.json's
`quantization_config` names the format, and the weights load straight into the native
int4/int8 layers - never expanded to a float model first.

A format (format.py's CheckpointFormat) parses the config, refusing by name every variant
it does not run, before any weight is read; its reader names each layer's scheme and
tensors, checked against the files' headers (loading.py, still before a weight is read),
and decodes them into IntWeights or Fp8Weights (weights.py), which layers.py puts on the
int4, int8 or fp8 kernels, or keeps as codes expanded per call where none takes them.

The formats read: compressed-tensors (compressed_tensors.py), GPTQ (gptq.py), AWQ in
its GEMM layout (awq.py) and block-wise FP8 (fp8_block.py); FP8 weights run on fp8.py's
layer. A config no format here
accepts is refused by name (quant/checkpoint_formats.py).

How to add a checkpoint format
------------------------------
Write one module here with a CheckpointFormat (its `name`, `accepts(settings)`, and
`parse(settings)` returning a FormatReader: `scheme(layer)`, `tensors(scheme, n, k)`,
`decode(scheme, tensors, n, k)`), a writer for the tests built from the format's own
description, and `register_format(YourFormat())` at the module's end; then import the
module below. Loading, the layers, `models info` and the refusals follow.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.engine.quant.checkpoint import (  # noqa: F401  (register)
    awq,
    compressed_tensors,
    fp8_block,
    gptq,
)
from tokenmill.engine.quant.checkpoint.format import CheckpointFormat, format_for
from tokenmill.engine.quant.checkpoint.loading import CheckpointQuantization, PendingLayer

# The config.json keys a quantized checkpoint's settings are under (compressed-tensors'
# older checkpoints use the second).
SETTINGS_KEYS = ("quantization_config", "compression_config")


def quantization_settings(model_dir: Path) -> tuple[str, dict] | None:
    """(key, settings) of a quantized checkpoint's config.json, or None."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # no config to read: the model's own loading says what is wrong
    for key in SETTINGS_KEYS:
        if raw.get(key):
            return key, raw[key]
    return None


def read_checkpoint_quantization(settings: dict) -> CheckpointQuantization | None:
    """The checkpoint's quantization as a registered format reads it, or None where no
    format accepts the settings.

    Raises:
        ValueError: a variant the accepting format does not run, by name.
    """
    fmt = format_for(settings)
    if fmt is None:
        return None
    return CheckpointQuantization(fmt.name, fmt.parse(settings))


__all__ = [
    "CheckpointFormat",
    "CheckpointQuantization",
    "PendingLayer",
    "quantization_settings",
    "read_checkpoint_quantization",
]
