"""A GGUF file's header read without decoding its arrays, for tests that need a few of a
large file's tensors.

gguf's own `GGUFReader` decodes every metadata array entry into numpy views on open - a
262,144-token vocabulary takes seconds to tens of seconds on a shared 2-core machine.
Here arrays are stepped over; scalar and string metadata is kept, and each tensor comes
back as gguf's own `ReaderTensor` over a memory map of the file, so only the bytes of
the tensors a test touches are read.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

# GGUF metadata value types -> struct formats; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_FLOAT_ITEMS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16,
}


def read_header(path: str | Path) -> tuple[dict[str, Any], dict[str, ReaderTensor]]:
    """(scalar and string metadata by key, every tensor by name) of a GGUF file."""
    with open(path, "rb") as f:
        data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    buffer = data.data
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    num_tensors, num_kv = struct.unpack_from("<QQ", buffer, 8)
    at = 24

    def string() -> str:
        nonlocal at
        (length,) = struct.unpack_from("<Q", buffer, at)
        at += 8 + length
        return bytes(buffer[at - length : at]).decode("utf-8")

    def value(kind: int) -> Any:
        nonlocal at
        if kind in _SCALARS:
            (result,) = struct.unpack_from("<" + _SCALARS[kind], buffer, at)
            at += struct.calcsize(_SCALARS[kind])
            return result
        if kind == _STRING:
            return string()
        if kind == _ARRAY:  # stepped over: None
            item, count = struct.unpack_from("<IQ", buffer, at)
            at += 12
            if item in _SCALARS:
                at += struct.calcsize(_SCALARS[item]) * count
            else:
                for _ in range(count):
                    value(item)
            return None
        raise ValueError(f"{path}: unknown metadata type {kind}")

    meta: dict[str, Any] = {}
    for _ in range(num_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buffer, at)
        at += 4
        found = value(kind)
        if found is not None:
            meta[key] = found
    infos = []
    for _ in range(num_tensors):
        name = string()
        (num_dims,) = struct.unpack_from("<I", buffer, at)
        dims = np.array(struct.unpack_from(f"<{num_dims}Q", buffer, at + 4), dtype=np.uint64)
        kind, offset = struct.unpack_from("<IQ", buffer, at + 4 + 8 * num_dims)
        at += 4 + 8 * num_dims + 12
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    alignment = meta.get("general.alignment", 32)
    start = -(-at // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        elements = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        nbytes = elements * type_size // block
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        raw = data[start + offset : start + offset + nbytes]
        if kind in _FLOAT_ITEMS:
            values = raw.view(_FLOAT_ITEMS[kind]).reshape(shape)
        else:
            values = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors[name] = ReaderTensor(
            name=name,
            tensor_type=kind,
            shape=dims,
            n_elements=elements,
            n_bytes=nbytes,
            data_offset=start + offset,
            data=values,
            field=None,
        )
    return meta, tensors
