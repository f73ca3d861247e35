"""GGUF file -> HF-layout model files: config and tokenizer from the metadata, and, for an
exported directory, every weight dequantized into fp32 safetensors.

A GGUF runs from its own file: gguf_tensors.index_gguf writes the config and tokenizer files with a
link to the GGUF, and the loader reads each tensor from the file as it loads it
(gguf_tensors.py), through `convert_tensor` below. `convert_gguf` exports a standalone
HF-layout directory (`tokenmill models convert --out`): every tensor is dequantized
(`gguf.quants.dequantize`: F32/F16/BF16, Q4_0 ... Q8_0, the K-quants) and kept in fp32,
which holds every value a GGUF encodes exactly - an fp32 engine runs the file's own
values, and a bf16 engine rounds them once as it loads. Both paths give the same tensors.
Tensors are renamed to HF names as the architecture's `GGUFLayout` says (each model
module declares its own), and the tokenizer is rebuilt from the metadata
(gguf_tokenizer.py). Before any tensor is read, the config is checked as any
config.json is, and every tensor's name and shape against the model it will load into
(loader/tensor_plan.py): a tensor the model has no place for is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file

from tokenmill.engine.loader.gguf_blocks import BLOCKS_FILE, write_blocks
from tokenmill.engine.loader.gguf_tokenizer import (
    build_generation_config,
    build_tokenizer,
    build_tokenizer_config,
)
from tokenmill.engine.loader.tensor_plan import TensorSource, build_on_meta, plan_tensors
from tokenmill.engine.models import gguf_layout, parse_config
from tokenmill.engine.models.registry import GGUFLayout, architecture_of

# Bumped whenever the output of a conversion changes, so cached conversions made by an
# older converter are not reused (model_files puts it in the cache key).
CONVERTER_VERSION = 5

WEIGHTS_FILE = "model.safetensors"
# The link, in a directory gguf_tensors.index_gguf writes, to the GGUF file its weights are read from.
GGUF_LINK = "model.gguf"
# Beside it: the file's tensor table and identity, so a start never parses the header.
TABLE_FILE = "gguf_tensors.json"
CONVERSION_RECORD = "tokenmill_conversion.json"

# Meta's Llama 3.1-3.3 rope scaling constants (all but `factor`), which llama.cpp bakes
# into the `rope_freqs` tensor instead of writing them as metadata.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32
) -> Path:
    """Convert a GGUF model file into an HF-layout directory (plus the decoder layers'
    quantized blocks as they are, for `quantization="gguf"`: loader/gguf_blocks.py).

    Args:
        gguf_path: the `.gguf` file (llama - with experts: Mixtral -, qwen2, qwen3,
            qwen3moe, olmoe or gemma3 architecture; byte-level BPE or SentencePiece
            vocabulary).
        out_dir: directory to write; created if missing, must be empty if it exists.
        dtype: dtype of the written weights (the tensors are dequantized to float32 first;
            the default keeps every value exact).

    Returns:
        `out_dir` as a Path, holding config.json, generation_config.json, model.safetensors,
        tokenizer.json, tokenizer_config.json and a conversion record.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"refusing to convert into non-empty directory {out_dir}")
    reader = GGUFReader(gguf_path)
    config = build_config(read_metadata(reader), {t.name: t for t in reader.tensors}, dtype)
    layout = architecture_of(config).gguf
    check_tensors(reader, config, gguf_path)
    tensors = convert_tensors(reader, config, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_model_files(reader, config, out_dir)
    weights_path = out_dir / WEIGHTS_FILE
    save_file(tensors, weights_path, metadata={"format": "pt"})
    # safetensors creates its file 0600 whatever the umask; match the files we write.
    shutil.copymode(out_dir / "config.json", weights_path)
    kept = write_blocks(reader, config, out_dir, layout.hf_tensor_name, unpermute_rows(config))
    if kept:
        shutil.copymode(out_dir / "config.json", out_dir / BLOCKS_FILE)
    write_record(reader, gguf_path, out_dir, {WEIGHTS_FILE: _sha256_file(weights_path)})
    return out_dir


def write_model_files(reader: GGUFReader, config: dict, out_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer files, from the metadata."""
    meta = read_metadata(reader)
    tokenizer = build_tokenizer(meta)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", build_generation_config(meta))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(meta))


def write_record(
    reader: GGUFReader, gguf_path: Path, out_dir: Path, weights_sha256: dict[str, str]
) -> None:
    record = {
        "converter_version": CONVERTER_VERSION,
        "source_file": gguf_path.name,
        "gguf_tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "weights_sha256": weights_sha256,
    }
    _write_json(out_dir / CONVERSION_RECORD, record)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF key/value fields as plain Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def build_config(
    meta: dict[str, Any], tensors: dict[str, ReaderTensor], dtype: torch.dtype
) -> dict:
    """The HF `config.json` for this GGUF's architecture and hyperparameters.

    Args:
        meta: the GGUF metadata (`read_metadata`).
        tensors: the GGUF tensors by name (only shapes are read, and `rope_freqs`).
        dtype: the dtype the weights will be written in.

    Returns:
        The config as a dict.
    """
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    layout = gguf_layout(arch, num_experts=get("expert_count") or 0)

    hidden_size = get("embedding_length")
    num_heads = get("attention.head_count")
    head_dim = (
        get("attention.key_length") or get("rope.dimension_count") or hidden_size // num_heads
    )
    config = {
        "architectures": [layout.hf_architecture],
        "model_type": layout.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        # The embedding's rows, which may exceed the tokenizer's vocabulary (padding).
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        layout.activation[0]: layout.activation[1],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        **({"mlp_bias": True} if "blk.0.ffn_up.bias" in tensors else {}),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if "rope_freqs.weight" in tensors:
        rope_freqs = dequantize(tensors["rope_freqs.weight"].data, GGMLQuantizationType.F32)
        config["rope_scaling"] = llama3_rope_scaling(rope_freqs, head_dim, config["rope_theta"])
    if layout.extra_config is not None:
        config.update(layout.extra_config(config, get))
    return config


def llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict:
    """The HF `rope_scaling` behind a GGUF's `rope_freqs` tensor (Llama 3.1+).

    llama.cpp stores Llama 3 rope scaling only as per-frequency divisors. Meta's models all
    use the same constants around their `factor`; we check that those constants reproduce
    every divisor rather than guess, since a wrong rope silently ruins long prompts.

    Args:
        rope_freqs: `[head_dim // 2]` divisors of the rotary frequencies.
        head_dim: rotary dimension.
        rope_theta: rotary base.

    Returns:
        `{"rope_type": "llama3", "factor": ..., "low_freq_factor": ..., ...}`.
    """
    factor = float(np.max(rope_freqs))
    params = dict(_LLAMA3_ROPE, factor=factor)
    context = params["original_max_position_embeddings"]
    wavelength = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    smooth = (context / wavelength - low) / (high - low)
    expected = np.where(
        wavelength < context / high,
        1.0,
        np.where(wavelength > context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != np.shape(rope_freqs) or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise ValueError(
            "GGUF rope_freqs do not match Llama 3 rope scaling (factor "
            f"{factor:g}, low 1, high 4, original context 8192): not supported"
        )
    return {"rope_type": "llama3", **params}


def check_tensors(reader: GGUFReader, config: dict, gguf_path: Path) -> None:
    """Raise ValueError, before any tensor is dequantized, for a config the architecture
    does not implement or a tensor the model has no place for (each named)."""
    layout = architecture_of(config).gguf
    sources = [
        TensorSource(
            layout.hf_tensor_name(t.name),
            torch.float32,
            tuple(int(d) for d in reversed(t.shape.tolist())),
            label=f"{t.name} ({layout.hf_tensor_name(t.name)})",
        )
        for t in reader.tensors
        if t.name != "rope_freqs.weight"  # build_config's
    ]
    model_config = parse_config(config)
    plan_tensors(build_on_meta(model_config), model_config, sources, where=str(gguf_path))


def convert_tensors(
    reader: GGUFReader, config: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor as `convert_tensor` makes it, by HF name."""
    layout = architecture_of(config).gguf
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # not a weight: build_config turns it into `rope_scaling`
        name, weight = convert_tensor(tensor, layout, config, dtype)
        tensors[name] = weight
    return tensors


def convert_tensor(
    tensor: ReaderTensor,
    layout: GGUFLayout,
    config: dict,
    dtype: torch.dtype = torch.float32,
    dequantized: torch.Tensor | None = None,
) -> tuple[str, torch.Tensor]:
    """One tensor of the file as the model directory holds it: dequantized, llama.cpp's
    q/k permutation and norm offset undone where the layout has them, under its HF name.
    Reads that tensor's bytes only.

    Args:
        tensor: the tensor as the file describes it (`GGUFReader.tensors`' kind).
        layout: the architecture's GGUF layout.
        config: the HF config built for the file (its head counts undo the permutation).
        dtype: the dtype to return.
        dequantized: the tensor's fp32 values already decoded (any shape of that many
            elements); None: `gguf.quants.dequantize` decodes `tensor.data`.

    Returns:
        (HF name, the tensor in `dtype`).
    """
    name = layout.hf_tensor_name(tensor.name)
    # GGUF lists dims fastest-first; numpy (and torch) order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if dequantized is None:
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        dequantized = torch.from_numpy(array)
    weight = unpermute_rows(config)(dequantized.reshape(shape), name)
    if layout.norm_offset and name.endswith("norm.weight"):
        weight = weight - layout.norm_offset  # stored as offset + w; HF keeps w
    return name, weight.to(dtype).contiguous()


def unpermute_rows(config: dict):
    """(rows, HF name) -> rows in HF order: llama.cpp's q/k permutation undone."""

    permuted = architecture_of(config).gguf.permuted_qk

    def unpermute(rows: torch.Tensor, name: str) -> torch.Tensor:
        if permuted and ".q_proj." in name:
            return unpermute_qk(rows, config["num_attention_heads"])
        if permuted and ".k_proj." in name:
            return unpermute_qk(rows, config["num_key_value_heads"])
        return rows

    return unpermute


def hf_tensor_name(gguf_name: str, *, architecture: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` for a GGUF of
    `architecture` (its general.architecture); unknown names raise ValueError."""
    return gguf_layout(architecture).hf_tensor_name(gguf_name)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (it interleaves each head's two rotary halves).

    Args:
        weight: `[num_heads * head_dim, ...]` rows as stored in the GGUF (weight or bias).
        num_heads: query heads for q, key/value heads for k.

    Returns:
        The same tensor with rows back in HF order (rotary halves contiguous per head).
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    # llama.cpp: w.reshape(heads, 2, half, *rest).swapaxes(1, 2); so view as (heads, half, 2).
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
