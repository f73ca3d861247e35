"""A GGUF's tensors read straight from the file, one tensor mapped at a time.

A GGUF model runs from its own file: model_files resolves it to a small cache directory
of config and tokenizer files (read from the GGUF's metadata, gguf_convert.py) with a
`model.gguf` link to the file itself, and the loader reads the weights from there. No
dequantized copy of the weights is ever written to disk.

Each tensor's bytes are mapped privately on their own (`mmap` from the page it starts
in) and dropped as soon as the tensor is consumed, so the load keeps at most one tensor's
pages of the file resident, not the whole file's.
- Float weights come out exactly as `gguf_convert.convert_tensor` makes them for a
  converted directory (dequantized to fp32, llama.cpp's q/k permutation and norm offset
  undone, HF names), converted to the engine's dtype as each is copied into its
  parameter.
- The decoder layers' quantized blocks (gguf_blocks.BLOCK_FORMATS) are handed to the
  `gguf` mode as the raw rows it decodes (`raw_blocks`), q/k rows un-permuted; that mode
  holds those layers out of the float load (quant/gguf_linear.py), so they are never
  expanded.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor

from tokenmill.engine.loader.gguf_blocks import is_layer_block
from tokenmill.engine.loader.gguf_convert import (
    GGUF_LINK,
    build_config,
    convert_tensor,
    read_metadata,
    unpermute_rows,
)
from tokenmill.engine.loader.tensor_plan import TensorSource
from tokenmill.engine.models.registry import architecture_of


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a model directory's weights are read from, or None for a directory
    of safetensors weights."""
    link = Path(model_dir) / GGUF_LINK
    return link if link.exists() or link.is_symlink() else None


@dataclass(frozen=True)
class GGUFTensors:
    """A GGUF file's tensor table and the HF config built for it (no tensor data)."""

    path: Path
    config: dict
    tensors: tuple[ReaderTensor, ...]  # `data` is the reader's memmap: never read here

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFTensors:
        """Parse the header. Only the metadata pages of the file are touched; the
        reader's mapping of the whole file is released with the reader."""
        reader = GGUFReader(path)
        config = build_config(
            read_metadata(reader), {t.name: t for t in reader.tensors}, torch.float32
        )
        return cls(Path(path), config, tuple(reader.tensors))

    @property
    def layout(self):
        return architecture_of(self.config).gguf

    def weights(self) -> list[ReaderTensor]:
        # rope_freqs is not a weight: build_config turned it into `rope_scaling`.
        return [t for t in self.tensors if t.name != "rope_freqs.weight"]

    def sources(self) -> list[TensorSource]:
        """Every weight as the float load sees it: its HF name, fp32, HF shape."""
        layout = self.layout
        return [
            TensorSource(
                layout.hf_tensor_name(t.name),
                torch.float32,
                tuple(int(d) for d in reversed(t.shape.tolist())),
                label=f"{t.name} ({layout.hf_tensor_name(t.name)})",
            )
            for t in self.weights()
        ]

    def block_types(self) -> dict[str, str]:
        """HF name -> GGML type of every quantized decoder linear weight (the formats the
        `gguf` mode cannot run included, so its error can name them)."""
        layout = self.layout
        return {
            layout.hf_tensor_name(t.name): t.tensor_type.name
            for t in self.tensors
            if is_layer_block(t.name, t.tensor_type.name)
        }

    def iter_float(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) for each weight named, read from the file in file order,
        exactly as a converted directory's model.safetensors holds it."""
        layout = self.layout
        with open(self.path, "rb") as f:
            for tensor in self.weights():
                if layout.hf_tensor_name(tensor.name) not in names:
                    continue
                mapped = tensor._replace(data=_map_data(f, tensor))
                name, weight = convert_tensor(mapped, layout, self.config, torch.float32)
                del mapped  # unmaps the tensor's pages
                yield name, weight

    def raw_blocks(self, hf_names: list[str]) -> dict[str, torch.Tensor]:
        """HF name -> the weight's raw blocks, one uint8 row per weight row, q/k rows in
        HF order (a row permutation moves whole rows of blocks: exact on the bytes)."""
        layout = self.layout
        by_name = {layout.hf_tensor_name(t.name): t for t in self.weights()}
        unpermute = unpermute_rows(self.config)
        raw = {}
        with open(self.path, "rb") as f:
            for name in hf_names:
                tensor = by_name[name]
                rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
                data = torch.from_numpy(_map_data(f, tensor).reshape(rows, -1))
                # A copy of its own: the mapping goes when this tensor's view does.
                raw[name] = unpermute(data, name).clone(memory_format=torch.contiguous_format)
                del data
        return raw


def _map_data(f, tensor: ReaderTensor) -> np.ndarray:
    """The tensor's bytes as the reader's `data` array (same dtype and shape), over a
    private mapping of just those bytes that lives as long as the array."""
    start = tensor.data_offset - tensor.data_offset % mmap.ALLOCATIONGRANULARITY
    length = tensor.data_offset + tensor.n_bytes - start
    if tensor.n_bytes == 0:
        return np.empty(tensor.data.shape, dtype=tensor.data.dtype)
    # ACCESS_COPY: writable for torch.from_numpy, never written back to the file.
    mapping = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY, offset=start)
    dtype = tensor.data.dtype
    array = np.frombuffer(
        mapping,
        dtype=dtype,
        count=tensor.n_bytes // dtype.itemsize,
        offset=tensor.data_offset - start,
    )
    return array.reshape(tensor.data.shape)
