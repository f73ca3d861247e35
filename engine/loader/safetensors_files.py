"""Reading safetensors files one tensor at a time, with plain file reads.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range), then the raw tensors: nothing in it can run code. Reading each
tensor with `readinto` instead of mapping the whole file keeps a load's peak memory at
the model plus one tensor - a mapped file's touched pages stay resident until it is
closed, which for a 540 MB checkpoint is 540 MB more at peak.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    # Quantized checkpoints' dtypes: read as what they are, so that the loader can refuse
    # them by name (tensor_plan.py) rather than by a parse error.
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
# Headers are small JSON; a larger one is not a safetensors file we should parse.
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: str | os.PathLike) -> list[TensorEntry]:
    """The tensors of a safetensors file, in file order.

    Raises:
        ValueError: the file is not a safetensors file this reader understands.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    data_start = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        nbytes = end - begin
        expected = dtype.itemsize * _numel(shape)
        if nbytes != expected or data_start + end > size:
            raise ValueError(f"{path}: tensor {name} does not fit its byte range")
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, nbytes))
    return sorted(entries, key=lambda e: e.offset)


def iter_tensors(
    path: str | os.PathLike, names: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the file (or those in `names`), each read into
    memory of its own as it is reached."""
    entries = [e for e in read_header(path) if names is None or e.name in names]
    with open(path, "rb", buffering=0) as f:
        for entry in entries:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            f.seek(entry.offset)
            _read_exactly(f, tensor, entry)
            yield entry.name, tensor


def _read_exactly(f, tensor: torch.Tensor, entry: TensorEntry) -> None:
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if entry.nbytes else b""
    done = 0
    while done < entry.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{f.name}: tensor {entry.name} is cut short")
        done += got


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
