"""A GGUF's quantized blocks, kept through conversion and decoded for the kernels.

At conversion (gguf_convert.py) the decoder layers' quantized weights are also written
as they are in the GGUF - raw block bytes, one uint8 row per weight row, in
`gguf_blocks.safetensors` with each tensor's GGML type in the file's metadata - so
`LLM(..., quantization="gguf")` runs the precision the GGUF's author chose instead of
the bf16 copy. q/k rows are un-permuted like the float weights (a row permutation moves
whole rows of blocks, so it is exact on the raw bytes).

`decode` turns blocks into integers and per-group float scales and offsets with
value = scale * q + offset computed exactly as `gguf.quants.dequantize` computes it
(tests check every bit). Formats, per block of 32 (K-quants: per 256):
  Q8_0  f16 d, 32 x int8                       d * q
  Q4_0  f16 d, 16 bytes of nibbles             d * (q - 8)
  Q4_1  f16 d, f16 m, 16 bytes of nibbles      d * q + m
  Q5_0  f16 d, 4 bytes high bits, nibbles      d * (q - 16)
  Q4_K  f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        (d * sc_j) * q - (dmin * m_j) per 32
  Q6_K  128 bytes low nibbles, 64 bytes high 2 bits, 16 x int8 scales, f16 d
        (d * sc_j) * (q - 32) per 16
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCKS_FILE = "gguf_blocks.safetensors"
# GGML type name -> (weights per block, bytes per block)
BLOCK_FORMATS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# The GGUF weights kept: the decoder layers' linear projections.
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def is_layer_block(gguf_name: str, kind: str) -> bool:
    """Whether a GGUF tensor is a decoder layer's linear weight stored quantized (of GGML
    type `kind`): the weights the `gguf` mode keeps as blocks, where it can run them."""
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[2] in _LINEAR_PARTS and kind not in _FLOAT_TYPES


@dataclass
class DecodedWeight:
    """value[n, k] = scale[n, k // group] * q[n, k] + (offset[n, k // group] or 0), in fp32."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N, K // group]
    offset: torch.Tensor | None  # fp32 [N, K // group], None for formats without one
    group: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.reshape(n, k // self.group, self.group).float() * self.scale[..., None]
        if self.offset is not None:
            groups = groups + self.offset[..., None]
        return groups.reshape(n, k)


def write_blocks(reader, config: dict, out_dir: Path, hf_name, unpermute_rows) -> dict[str, str]:
    """Write the decoder linear weights of a GGUF that are in BLOCK_FORMATS, raw.

    Args:
        reader: the open GGUFReader.
        config: the HF config built for it.
        out_dir: the conversion directory.
        hf_name: GGUF tensor name -> HF name.
        unpermute_rows: (rows tensor, HF name) -> rows in HF order.
    Returns:
        HF name -> GGML type name of every quantized decoder linear weight (only those in
        BLOCK_FORMATS are written; empty: no file written).
    """
    tensors, types = {}, {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if not is_layer_block(tensor.name, kind):
            continue
        name = hf_name(tensor.name)
        types[name] = kind  # formats we cannot run are listed, so the error can name them
        if kind not in BLOCK_FORMATS:
            continue
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        tensors[name] = unpermute_rows(raw, name).contiguous()
    if types:
        path = out_dir / BLOCKS_FILE
        save_file(tensors, path, metadata={"format": "gguf-blocks", "types": json.dumps(types)})
    return types


def read_types(model_dir: Path) -> dict[str, str] | None:
    """HF name -> GGML type of the kept blocks, or None when the model has none."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["types"])


def load_raw(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The raw uint8 rows of the named tensors."""
    with safe_open(str(Path(model_dir) / BLOCKS_FILE), framework="pt") as f:
        return {name: f.get_tensor(name) for name in names}


def decode(raw: torch.Tensor, kind: str) -> DecodedWeight:
    """raw uint8 [N, bytes per row] in GGML type `kind` -> its DecodedWeight."""
    per_block, nbytes = BLOCK_FORMATS[kind]
    rows = raw.shape[0]
    blocks = raw.numpy().reshape(-1, nbytes)  # [N * blocks per row, nbytes]
    q, scale, offset, group = _DECODERS[kind](blocks)
    k = blocks.shape[0] // rows * per_block

    def as_rows(array: np.ndarray | None, width: int) -> torch.Tensor | None:
        return (
            None
            if array is None
            else torch.from_numpy(np.ascontiguousarray(array)).reshape(rows, width)
        )

    return DecodedWeight(
        q=as_rows(q.astype(np.int8), k),
        scale=as_rows(scale.astype(np.float32), k // group),
        offset=as_rows(None if offset is None else offset.astype(np.float32), k // group),
        group=group,
    )


def _f16(columns: np.ndarray) -> np.ndarray:
    return columns.copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: low nibbles are weights 0..15, high 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(blocks):
    return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), None, 32


def _q4_0(blocks):
    return _nibbles(blocks[:, 2:]).astype(np.int8) - 8, _f16(blocks[:, :2]), None, 32


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 32


def _q5_0(blocks):
    high = blocks[:, 2:6].copy().view(np.uint32)  # bit j: the 5th bit of weight j
    bits = (high >> np.arange(32, dtype=np.uint32)) & 1
    q = _nibbles(blocks[:, 6:]) | (bits.astype(np.uint8) << 4)
    return q.astype(np.int8) - 16, _f16(blocks[:, :2]), None, 32


def _q4_k(blocks):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16]
    # Sub-blocks 0-3: 6 bits in bytes 0-3 (scale) and 4-7 (min); 4-7: low 4 bits in
    # bytes 8-11, high 2 bits in the top bits of bytes 0-3 (scale) and 4-7 (min).
    sc = np.empty((n, 8), dtype=np.uint8)
    mn = np.empty((n, 8), dtype=np.uint8)
    sc[:, :4] = packed[:, :4] & 63
    mn[:, :4] = packed[:, 4:8] & 63
    sc[:, 4:] = (packed[:, 8:] & 0x0F) | ((packed[:, :4] >> 6) << 4)
    mn[:, 4:] = (packed[:, 8:] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    scale = d * sc.astype(np.float32)
    offset = -(dmin * mn.astype(np.float32))
    # 4 runs of 32 bytes: low nibbles are sub-block 2j, high nibbles 2j + 1.
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return q, scale, offset, 32


def _q6_k(blocks):
    n = blocks.shape[0]
    low = blocks[:, :128].reshape(n, 2, 2, 32)  # [half, first/second 32 bytes, 32]
    high = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    # Per half of 128: nibble runs (low of bytes 0-31, low of 32-63, high of 0-31, high
    # of 32-63) take the 2-bit fields 0, 1, 2, 3 of the high bytes.
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [n, 2, 4, 32]
    fields = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (nibbles | (fields << 4)).astype(np.int8) - 32
    return q.reshape(n, 256), d * scales, None, 16


_DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q4_K": _q4_k,
    "Q6_K": _q6_k,
}
