"""Reading safetensors files one tensor at a time: mapped where the tensor is the
parameter, read into memory of its own where it is converted.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range), then the raw tensors: nothing in it can run code.

A tensor the model keeps exactly as stored (same dtype, a whole parameter, on the CPU)
is mapped (`map_tensors`): the parameter's memory is the file's pages in the page cache,
so an 8B bf16 model takes no anonymous memory for those weights and loads at the disk's
speed. The mapping is private: a write to such a parameter copies the page it touches
and never reaches the file. Every other tensor - converted to another dtype, or one part
of a fused or stacked parameter - is read with `readinto` into memory of its own and
copied, one at a time; mapping those would keep each touched page resident beside the
copy until the file was closed.
"""

from __future__ import annotations

import json
import mmap
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


def map_tensors(path: str | os.PathLike, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """name -> a tensor whose memory is the file's own bytes (a private, copy-on-write
    mapping), for each of `entries` (from this file's `read_header`).

    Raises:
        ValueError: an entry whose offset is not a multiple of its element size (the
            tensor could not be used in place; read it with `iter_tensors`).
    """
    mapped = {}
    with open(path, "rb") as f:
        for entry in entries:
            if entry.offset % entry.dtype.itemsize:
                raise ValueError(f"{path}: tensor {entry.name} is not aligned to its dtype")
            # One mapping per tensor, from the page it starts in: when the engine drops
            # a tensor (a linear layer packed into oneDNN's layout), its mapping and the
            # pages it touched go with it; one mapping of the whole file would keep them.
            start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
            # Writable so torch accepts the buffer; MAP_PRIVATE keeps writes out of the file.
            mapping = mmap.mmap(
                f.fileno(),
                entry.offset + entry.nbytes - start,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=start,
            )
            # frombuffer holds the mapping: it is unmapped when the tensor is freed.
            flat = torch.frombuffer(
                mapping, dtype=entry.dtype, count=_numel(entry.shape), offset=entry.offset - start
            )
            mapped[entry.name] = flat.view(entry.shape)
    return mapped


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
