"""Random-weight models at published shapes (scale_shapes.py), written tensor by tensor.

A model directory in HF layout: config.json, safetensors shards (with their index when
there are several), and the embedded default model's tokenizer. The checkpoint is never
in memory: each tensor is drawn and written in chunks of CHUNK_ELEMENTS values, so an
8B model in bf16 (16 GB) or OLMoE in fp32 (28 GB) builds within a few hundred MB of RAM.

Values are deterministic: each tensor draws from a generator seeded by (seed, its name),
chunk by chunk, so the same arguments give the same bytes on every machine. Built
directories are cached under the tokenmill cache (`scale-models/`), named by shape, layer
count, overrides, dtype and seed; a directory appears only once complete (written
beside it, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from tokenmill.bench.scale_shapes import (
    INIT_STD,
    SCALE_RECORD,
    TensorSpec,
    checkpoint_tensors,
    shape_config,
)

# Bump when the bytes a given set of arguments builds change: old cache entries are
# then left alone rather than reused.
BUILD_VERSION = 1
CHUNK_ELEMENTS = 1 << 22  # values drawn at once: 16 MB in fp32
MAX_SHARD_BYTES = 2 << 30
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_scale_model(
    name: str,
    *,
    num_layers: int | None = None,
    overrides: dict | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
) -> Path:
    """The directory of a random-weight model at shape `name`, built now if not cached.

    Args:
        name: a scale_shapes.SHAPE_NAMES entry.
        num_layers: fewer layers than published (per-layer figures scale from it).
        overrides: shrunk dimensions (scale_shapes.SHRINKABLE), for tests.
        dtype: "bfloat16" or "float32", the checkpoint's dtype.
        seed: the random seed of every tensor.
        out_dir: build here instead of the cache (must not exist yet).

    Raises:
        ValueError: an unknown shape or dtype, or a bad override (before anything is written).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    config = shape_config(name, num_layers=num_layers, overrides=overrides)
    tokens = _tokenizer_vocab_size()
    if config["vocab_size"] < tokens:  # Mixtral's 32,000: prompts' ids would not embed
        raise ValueError(
            f"{name}'s vocabulary of {config['vocab_size']:,} is smaller than the tokenizer's "
            f"{tokens:,} (the embedded default model's): override vocab_size to {tokens:,} "
            "or more"
        )
    tensors = checkpoint_tensors(config)
    if out_dir is None:
        from tokenmill.engine import cache_dir

        out_dir = cache_dir() / "scale-models" / _cache_name(name, config, dtype, seed)
        if (out_dir / "config.json").is_file():
            return out_dir
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists: build into a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _write_shards(staging, tensors, DTYPES[dtype], seed)
        bos, eos = _copy_tokenizer(staging)
        config = {**config, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype}
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / SCALE_RECORD).write_text(
            json.dumps({"shape": name, "seed": seed, "build_version": BUILD_VERSION}, indent=2)
        )
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _cache_name(name: str, config: dict, dtype: str, seed: int) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    return f"{name}-L{config['num_hidden_layers']}-{dtype}-s{seed}-{digest}-v{BUILD_VERSION}"


def _write_shards(out: Path, tensors: list[TensorSpec], dtype: torch.dtype, seed: int) -> None:
    """Split `tensors` into shards of at most MAX_SHARD_BYTES (in checkpoint order) and
    write each; several shards get transformers' index file."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensors:
        nbytes = _numel(spec.shape) * dtype.itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", shards[0], dtype, seed)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / filename, shard, dtype, seed)
        weight_map.update({spec.name: filename for spec in shard})
    total = sum(_numel(s.shape) * dtype.itemsize for s in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_safetensors(
    path: Path, tensors: list[TensorSpec], dtype: torch.dtype, seed: int
) -> None:
    """One safetensors file: the header from the shapes alone, then each tensor's values
    drawn and written chunk by chunk."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in tensors:
        nbytes = _numel(spec.shape) * dtype.itemsize
        header[spec.name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensors start 8-byte aligned (mmap-able)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for spec in tensors:
            for chunk in tensor_chunks(spec, dtype, seed):
                f.write(chunk.reshape(-1).view(torch.uint8).numpy().data)


def tensor_chunks(spec: TensorSpec, dtype: torch.dtype, seed: int):
    """The values of `spec` in `dtype`, [rows, columns] chunks of whole rows (at most
    CHUNK_ELEMENTS values, or one row), so a writer can quantize each chunk by itself."""
    columns = spec.shape[-1]
    rows = _numel(spec.shape) // columns
    if spec.init == "ones":
        yield torch.ones(rows, columns, dtype=dtype)
        return
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    step = max(1, CHUNK_ELEMENTS // columns)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        yield torch.randn(count, columns, generator=generator).mul_(INIT_STD).to(dtype)


def tensor_seed(seed: int, name: str) -> int:
    """A tensor's own seed: its values do not depend on which tensors come before it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _copy_tokenizer(out: Path) -> tuple[int | None, int | None]:
    """The embedded default model's tokenizer files, copied into `out`; its (bos, eos)."""
    from tokenmill.engine import DEFAULT_MODEL, resolve_model

    source = Path(resolve_model(DEFAULT_MODEL))
    for filename in _TOKENIZER_FILES:
        shutil.copyfile(source / filename, out / filename)
    config = json.loads((source / "config.json").read_text())
    return config.get("bos_token_id"), config.get("eos_token_id")


def _tokenizer_vocab_size() -> int:
    """The embedded default model's vocabulary size (its tokenizer's ids lie below it)."""
    from tokenmill.engine import DEFAULT_MODEL, resolve_model

    source = Path(resolve_model(DEFAULT_MODEL))
    return json.loads((source / "config.json").read_text())["vocab_size"]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
