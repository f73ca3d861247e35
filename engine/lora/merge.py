"""One LoRA adapter merged into a model's weights, written as a model directory: PEFT's
merge, W + scaling * B @ A for each targeted projection - what a user without
per-request adapters does once per fine-tune (and the bench's merge-per-adapter
baseline)."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file

from tokenmill.engine.loader.gguf_convert import GGUF_LINK
from tokenmill.engine.loader.gguf_tensors import GGUFTensors, gguf_source
from tokenmill.engine.loader.model_files import CONVERSION_RECORD, weight_files
from tokenmill.engine.loader.safetensors_files import iter_tensors
from tokenmill.engine.lora.adapters import describe_adapter, load_adapter
from tokenmill.engine.lora.layers import LORA_TARGETS
from tokenmill.engine.models import load_config

# Any rank: a merge is not bounded by the slots' max_lora_rank.
_ANY_RANK = 1 << 16


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base model with one adapter merged into its weights, as a model directory.

    Returns:
        out_dir: the base's config and tokenizer files and a merged model.safetensors.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir)
    description = describe_adapter("merge", adapter_dir, config, max_rank=_ANY_RANK)
    deltas = {}
    for target, (a, b) in load_adapter(description).items():
        parent = LORA_TARGETS[target.module][0]
        name = f"model.layers.{target.layer}.{parent}.{target.module}.weight"
        deltas[name] = (b @ a) * target.scaling
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = {}
    for name, tensor in _base_tensors(model_dir):
        if name in deltas:
            tensor = (tensor.float() + deltas[name]).to(tensor.dtype)
        merged[name] = tensor
    save_file(merged, out_dir / "model.safetensors")
    # Config, tokenizer and generation files; not the weights, their index or the link
    # to a GGUF, or the record of the base's conversion (its hashes are not the merged
    # weights').
    skipped = {"model.safetensors.index.json", CONVERSION_RECORD, GGUF_LINK}
    for file in model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in skipped:
            shutil.copy2(file, out_dir / file.name)
    return out_dir


def _base_tensors(model_dir: Path):
    """(name, tensor) of every base weight: a GGUF model's in fp32, as it loads them."""
    gguf_path = gguf_source(model_dir)
    if gguf_path is not None:
        gguf = GGUFTensors.open_dir(model_dir)
        yield from gguf.iter_float({source.name for source in gguf.sources()})
        return
    for file in weight_files(model_dir):
        yield from iter_tensors(file)
