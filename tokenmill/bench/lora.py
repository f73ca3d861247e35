"""LoRA adapters for the `lora8` preset: random PEFT adapters of the benchmark's model, and
the merge-per-adapter baseline's merged checkpoints.

Adapters are written as PEFT saves them (adapter_config.json + adapter_model.safetensors,
lora_A with PEFT's default Kaiming-uniform init, lora_B drawn non-zero), seeded, so every
run of a preset serves the same adapters. Merging is PEFT's merge: W + scaling * B @ A
per targeted projection, written as a full checkpoint next to the base model's other
files - what a user without per-request adapters does once per fine-tune.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.engine.loader.model_files import CONVERSION_RECORD, weight_files
from tokenmill.engine.loader.safetensors_files import iter_tensors
from tokenmill.engine.lora.adapters import describe_adapter, load_adapter
from tokenmill.engine.lora.layers import LORA_TARGETS, target_shapes
from tokenmill.engine.models import load_config

ALL_TARGETS = tuple(LORA_TARGETS)


def make_adapters(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    num_adapters: int,
    rank: int,
    alpha: int | None = None,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    b_std: float = 0.01,
) -> list[Path]:
    """Write `num_adapters` random LoRA adapters of the model in model_dir (lora_B's
    entries drawn with standard deviation `b_std`).

    Returns:
        Their directories, adapter-00 ... in order.
    """
    config = load_config(model_dir)
    shapes = target_shapes(config)
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


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base model with one adapter merged into its weights, as a model directory.

    Returns:
        out_dir: the base's config and tokenizer files and a merged model.safetensors.
    """

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir)
    description = describe_adapter("merge", adapter_dir, config, max_rank=1 << 16)
    deltas = {}
    for target, (a, b) in load_adapter(description).items():
        parent = LORA_TARGETS[target.module][0]
        name = f"model.layers.{target.layer}.{parent}.{target.module}.weight"
        deltas[name] = (b @ a) * target.scaling
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = {}
    for file in weight_files(model_dir):
        for name, tensor in iter_tensors(file):
            if name in deltas:
                tensor = (tensor.float() + deltas[name]).to(tensor.dtype)
            merged[name] = tensor
    save_file(merged, out_dir / "model.safetensors")
    # Config, tokenizer and generation files; not the weights, their index, or the
    # record of the base's conversion (its hashes are not the merged weights').
    skipped = {"model.safetensors.index.json", CONVERSION_RECORD}
    for file in model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in skipped:
            shutil.copy2(file, out_dir / file.name)
    return out_dir


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
    llm.engine.block_manager.forget_cache()
    return time.perf_counter() - start
