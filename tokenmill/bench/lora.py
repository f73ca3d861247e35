"""LoRA adapters for the `lora8` preset: random PEFT adapters of the benchmark's model, and
the merge-per-adapter baseline's merged checkpoints.

Adapters are written as PEFT saves them (adapter_config.json + adapter_model.safetensors,
lora_A with PEFT's default Kaiming-uniform init, lora_B drawn non-zero), seeded, so every
run of a preset serves the same adapters. The merge-per-adapter baseline's checkpoints
come from the engine's `merge_adapter` (PEFT's merge, written as a full checkpoint).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.engine import load_config, lora_target_shapes


def make_adapters(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    num_adapters: int,
    rank: int,
    alpha: int | None = None,
    targets: tuple[str, ...] | None = None,
    seed: int = 0,
    b_std: float = 0.01,
) -> list[Path]:
    """Write `num_adapters` random LoRA adapters of the model in model_dir (lora_B's
    entries drawn with standard deviation `b_std`), on `targets` (None: every projection
    the engine serves adapters on).

    Returns:
        Their directories, adapter-00 ... in order.
    """
    config = load_config(model_dir)
    shapes = lora_target_shapes(config)
    targets = tuple(shapes) if targets is None else targets
    paths = []
    for index in range(num_adapters):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for target in targets:
                shape = shapes[target]
                prefix = f"base_model.model.model.layers.{layer}.{shape.parent}.{target}"
                bound = 1 / math.sqrt(shape.in_features)  # nn.Linear's (PEFT's) lora_A init
                a = (torch.rand(rank, shape.in_features, generator=generator) * 2 - 1) * bound
                b = torch.randn(shape.out_features, rank, generator=generator) * b_std
                tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
        path = Path(out_dir) / f"adapter-{index:02d}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        settings = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": alpha if alpha is not None else rank,
            "target_modules": list(targets),
            "bias": "none",
            "base_model_name_or_path": None,
        }
        (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
        paths.append(path)
    return paths


def load_adapters_before_the_clock(llm, requests: list, prompt: list[int], params) -> float:
    """Read every adapter `requests` name (None: the base model) and fill its slot with one
    short generate per adapter, then empty the prefix cache, as a LoRA system's warm-up
    does before its clock starts (the model's load is outside the clock too).

    Returns:
        The seconds it took.
    """
    adapters = list(dict.fromkeys(requests))
    start = time.perf_counter()
    llm.generate([prompt] * len(adapters), params, lora_request=adapters)
    llm.reset_prefix_cache()
    return time.perf_counter() - start
