"""Model architectures: one module each, registered by the module itself.

`parse_config` / `load_config` read a model directory's config.json into its
architecture's `ModelConfig`; `model_class` gives the nn.Module that runs it.

How to add an architecture
--------------------------
Write one module in this package (llama.py is the model to follow; qwen2.py shows an
architecture that differs only in its config). It holds:
- the model: an nn.Module over a flat batch, `forward(input_ids, positions, meta)` ->
  hidden states, `compute_logits(hidden)`, `attach_rotary(max_positions, device)`, and
  `packed_modules` (checkpoint names that load into fused projections);
- `parse_config(raw)`: config.json -> a ModelConfig (or a subclass with the fields only
  this family has), defaults as transformers' config class has them;
- `CONFIG_FIELDS`, a ConfigFields (config_fields.py): every field of transformers'
  config class for it, handled, harmless (why) or refused (why, and its "off" values) -
  tests/engine/test_config_fields.py holds the table to transformers' class and proves
  each refusal;
- a GGUFLayout, if llama.cpp writes the family: its general.architecture, tensor names,
  q/k permutation and norm offset, and the config.json fields its metadata gives;
- `register(Architecture(names=(...), model_class=..., parse_config=...,
  config_fields=CONFIG_FIELDS, gguf=..., tasks=...))`: `tasks` says what it serves
  (generate, embed, classify, rerank).
An encoder (bert.py: `is_encoder = True`, `forward(input_ids, positions, meta,
token_type_ids)` with bidirectional attention, no cache) runs in the encoder runner; a
pooling decoder (decoder_heads.py) has no lm_head and runs in the decode loop. A model
with a classification head names the token it reads (`head_pooling`) and gives
`classify(hidden) -> logits`. Every checkpoint tensor must fill a parameter: a model
whose checkpoints hold tensors it deliberately leaves gives `checkpoint_name(name)`
returning None for them (loader/tensor_plan.py refuses any other by name).
This package imports every module in it, so nothing else changes. Prove it against
transformers with random weights (tests/engine/test_hf_parity.py and hf_models.py).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from pathlib import Path

from torch import nn

from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.config_fields import ConfigFields
from tokenmill.engine.models.registry import (
    GENERATE,
    TASKS,
    Architecture,
    GGUFLayout,
    architecture_of,
    gguf_layout,
    register,
    supported_architectures,
)

# Modules of this package that are not architectures.
_NOT_ARCHITECTURES = frozenset(
    {
        "attention",
        "config",
        "config_fields",
        "fused_linear",
        "layers",
        "moe",
        "qwen2_5_vision",
        "registry",
        "rope",
        "siglip",
        "vision_segments",
    }
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_ARCHITECTURES:
        importlib.import_module(f"{__name__}.{_module.name}")


def parse_config(raw: dict) -> ModelConfig:
    """A config.json's contents -> its architecture's ModelConfig.

    Raises:
        ValueError: an architecture the engine does not implement (naming those it does),
            or a config field set to a value it does not implement (naming the field).
    """
    architecture = architecture_of(raw)
    name = (raw.get("architectures") or [architecture.names[0]])[0]
    architecture.config_fields.check(raw, name)
    return architecture.parse_config(raw)


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an HF-layout model directory's config.json."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        return parse_config(json.load(f))


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The nn.Module class that runs a model of this config."""
    return architecture_for(config).model_class


def architecture_for(config: ModelConfig) -> Architecture:
    """The registered architecture of a parsed config."""
    return architecture_of({"architectures": [config.architecture]})


__all__ = [
    "GENERATE",
    "TASKS",
    "Architecture",
    "ConfigFields",
    "architecture_for",
    "architecture_of",
    "GGUFLayout",
    "ModelConfig",
    "gguf_layout",
    "load_config",
    "model_class",
    "parse_config",
    "register",
    "supported_architectures",
]
