"""Random PEFT LoRA adapters saved as PEFT saves them, and PEFT's merged model as the
reference an adapter's outputs must equal."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Adapter:
    name: str
    path: Path
    merged: torch.nn.Module  # PEFT's merge_and_unload() of the base with this adapter


def save_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    alpha: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    b_std: float = 0.2,
    merge: bool = True,
    config_changes: dict | None = None,
    **lora_config,
) -> Adapter:
    """Train-free: a LoRA adapter of the model in base_dir with random lora_A (PEFT's init)
    and random, non-zero lora_B, saved to out_dir.

    Args:
        config_changes: entries written over the saved adapter_config.json.
        **lora_config: more peft.LoraConfig fields (use_rslora, rank_pattern, ...).
    """
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **lora_config)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    model.save_pretrained(out_dir)
    if config_changes:
        file = out_dir / "adapter_config.json"
        settings = json.loads(file.read_text())
        settings.update(config_changes)
        file.write_text(json.dumps(settings))
    merged = model.merge_and_unload().eval() if merge else None
    return Adapter(out_dir.name, out_dir, merged)
