"""A GGUF's tensors read straight from the file, one tensor mapped at a time.

A GGUF model runs from its own file: model_files resolves it to a small cache directory
(`index_gguf`: config and tokenizer files from the GGUF's metadata, the file's tensor
table with its size and mtime, and a `model.gguf` link to the file), and the loader
reads the weights from there. No dequantized copy of the weights is ever written to
disk, and a start never parses the GGUF header again (gguf's reader takes tens of
seconds over a 150k-token vocabulary); a file changed since it was indexed is refused.

Each tensor's bytes are mapped privately on their own (`mmap` from the page it starts
in) and dropped as soon as the tensor is consumed, so the load keeps at most one tensor's
pages of the file resident, not the whole file's.
- Float weights come out exactly as `gguf_convert.convert_tensor` makes them for an
  exported directory (dequantized to fp32, llama.cpp's q/k permutation and norm offset
  undone, HF names), converted to the engine's dtype as each is copied into its
  parameter (an fp32 engine takes each whole tensor as it is read, without a copy).
- The decoder layers' quantized blocks (gguf_blocks.BLOCK_FORMATS) are handed to the
  `gguf` mode as the raw rows it decodes (`raw_blocks`), q/k rows un-permuted; that mode
  holds those layers out of the float load (quant/gguf_linear.py), so they are never
  expanded."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from tokenmill.engine.kernels import gguf_dequantize
from tokenmill.engine.loader.gguf_blocks import BLOCK_FORMATS, decode, is_layer_block
from tokenmill.engine.loader.gguf_convert import (
    GGUF_LINK,
    TABLE_FILE,
    build_config,
    check_tensors,
    convert_tensor,
    read_metadata,
    unpermute_rows,
    write_model_files,
    write_record,
)
from tokenmill.engine.loader.tensor_plan import TensorSource
from tokenmill.engine.models.registry import architecture_of


def index_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, gguf_sha256: str) -> Path:
    """Write the directory a GGUF model runs from without converting its weights: the
    config and tokenizer files from its metadata, the tensor table (TABLE_FILE) and a
    `model.gguf` link to the file, from which the loader reads each tensor.

    Every check `convert_gguf` makes is made here, from the header alone: the config, and
    every tensor's name and shape against the model it will load into.

    Args:
        gguf_path: the `.gguf` file (as for `convert_gguf`).
        out_dir: directory to write; created if missing, must be empty if it exists.
        gguf_sha256: the file's sha256 (model_files keeps it per file), recorded as the
            weights' hash for the job ledger.

    Returns:
        `out_dir` as a Path.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"refusing to index into non-empty directory {out_dir}")
    reader = GGUFReader(gguf_path)
    tensors = GGUFTensors.of_reader(reader, gguf_path)
    check_tensors(reader, tensors.config, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_model_files(reader, tensors.config, out_dir)
    os.symlink(gguf_path.resolve(), out_dir / GGUF_LINK)
    tensors.write_table(out_dir, file_identity(gguf_path))
    write_record(reader, gguf_path, out_dir, {GGUF_LINK: gguf_sha256})
    return out_dir


def relink(model_dir: Path, gguf_path: Path) -> None:
    """Point a GGUF model directory's link at `gguf_path` - a file with the bytes it was
    indexed from (the caller has checked its sha256) - and record that file's identity:
    a moved, copied or touched file is taken again without re-parsing it. Each step is
    atomic (a reader sees the old link or the new one)."""
    link = model_dir / GGUF_LINK
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(gguf_path.resolve(), tmp)
    os.replace(tmp, link)
    table = json.loads((model_dir / TABLE_FILE).read_text(encoding="utf-8"))
    table["file"] = file_identity(gguf_path)
    tmp = model_dir / f".{TABLE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(table) + "\n", encoding="utf-8")
    os.replace(tmp, model_dir / TABLE_FILE)


def link_is_current(model_dir: Path) -> bool:
    """Whether the directory's link leads to a file that is as it was recorded."""
    link = model_dir / GGUF_LINK
    if not link.exists():
        return False
    table = json.loads((model_dir / TABLE_FILE).read_text(encoding="utf-8"))
    return table["file"] == file_identity(link)


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a model directory's weights are read from, or None for a directory
    of safetensors weights."""
    link = Path(model_dir) / GGUF_LINK
    return link if link.exists() or link.is_symlink() else None


# fp32 output decoded at once by _decode_blocks.
_DECODE_BYTES = 8 << 20
# Typed arrays in gguf's reader; every other type is read as raw uint8 rows of blocks.
_TYPED = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a GGUF file, as its header says."""

    name: str  # the GGUF's name
    kind: str  # GGML type name
    dims: tuple[int, ...]  # fastest-first, as GGUF lists them
    offset: int  # from the start of the file
    nbytes: int

    def as_reader_tensor(self, data: np.ndarray | None = None) -> ReaderTensor:
        """The tensor as gguf's reader describes it (what convert_tensor takes)."""
        return ReaderTensor(
            name=self.name,
            tensor_type=GGMLQuantizationType[self.kind],
            shape=np.array(self.dims, dtype=np.uint64),
            n_elements=int(np.prod(self.dims)),
            n_bytes=self.nbytes,
            data_offset=self.offset,
            data=data,
            field=None,
        )

    def array_layout(self) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of the reader's `data` array for this tensor."""
        np_dims = tuple(reversed(self.dims))
        if self.kind in _TYPED:
            return np.dtype(_TYPED[self.kind]), np_dims
        kind = GGMLQuantizationType[self.kind]
        return np.dtype(np.uint8), quant_shape_to_byte_shape(np_dims, kind)


@dataclass(frozen=True)
class GGUFTensors:
    """A GGUF file's tensor table and the HF config built for it (no tensor data)."""

    path: Path
    config: dict
    entries: tuple[TensorEntry, ...]

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFTensors:
        """Parse the file's header with gguf's reader (tens of seconds for a vocabulary
        of 150k tokens: done once, when the file is indexed)."""
        return cls.of_reader(GGUFReader(path), path)

    @classmethod
    def of_reader(cls, reader: GGUFReader, path: str | os.PathLike) -> GGUFTensors:
        config = build_config(
            read_metadata(reader), {t.name: t for t in reader.tensors}, torch.float32
        )
        entries = tuple(
            TensorEntry(
                t.name,
                t.tensor_type.name,
                tuple(int(d) for d in t.shape.tolist()),
                int(t.data_offset),
                int(t.n_bytes),
            )
            for t in reader.tensors
        )
        return cls(Path(path), config, entries)

    @classmethod
    def open_dir(cls, model_dir: str | os.PathLike, *, check_file: bool = True) -> GGUFTensors:
        """The tensors of the GGUF a model directory runs from, from the table written
        when it was indexed (its config.json and TABLE_FILE: the file is not parsed).

        Raises:
            ValueError: the file behind the link is not the one indexed (another size
                or modification time): its offsets could be another file's.
        """
        model_dir = Path(model_dir)
        table = json.loads((model_dir / TABLE_FILE).read_text(encoding="utf-8"))
        link = model_dir / GGUF_LINK
        if check_file and not link.exists():
            raise ValueError(
                f"{link} leads to no file (the GGUF moved or was deleted): load the .gguf "
                "file itself again to link it"
            )
        if check_file and file_identity(link) != table["file"]:
            raise ValueError(
                f"{link} is not the GGUF file that was indexed there (size or modification "
                "time differ): load the .gguf file itself again to re-index it"
            )
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        entries = tuple(
            TensorEntry(e["name"], e["type"], tuple(e["dims"]), e["offset"], e["nbytes"])
            for e in table["tensors"]
        )
        return cls(link, config, entries)

    def write_table(self, model_dir: Path, identity: dict) -> None:
        """Write TABLE_FILE: the tensor table and the file's identity (`file_identity`),
        atomically."""
        table = {
            "file": identity,
            "tensors": [
                {"name": e.name, "type": e.kind, "dims": list(e.dims), "offset": e.offset}
                | {"nbytes": e.nbytes}
                for e in self.entries
            ],
        }
        tmp = model_dir / f".{TABLE_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(table) + "\n", encoding="utf-8")
        os.replace(tmp, model_dir / TABLE_FILE)

    @property
    def layout(self):
        return architecture_of(self.config).gguf

    def weights(self) -> list[TensorEntry]:
        # rope_freqs is not a weight: build_config turned it into `rope_scaling`.
        return [e for e in self.entries if e.name != "rope_freqs.weight"]

    def sources(self) -> list[TensorSource]:
        """Every weight as the float load sees it: its HF name, fp32, HF shape."""
        layout = self.layout
        return [
            TensorSource(
                layout.hf_tensor_name(e.name),
                torch.float32,
                tuple(reversed(e.dims)),
                label=f"{e.name} ({layout.hf_tensor_name(e.name)})",
            )
            for e in self.weights()
        ]

    def block_types(self) -> dict[str, str]:
        """HF name -> GGML type of every quantized decoder linear weight (the formats the
        `gguf` mode cannot run included, so its error can name them)."""
        layout = self.layout
        return {
            layout.hf_tensor_name(e.name): e.kind
            for e in self.entries
            if is_layer_block(e.name, e.kind)
        }

    def stored_bytes(self) -> dict[str, int]:
        """HF name -> the bytes each weight takes in the file (the tensor table's sizes:
        a quantized one's blocks, scales included)."""
        layout = self.layout
        return {layout.hf_tensor_name(e.name): e.nbytes for e in self.weights()}

    def iter_float(
        self, names: set[str], bf16_names: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) for each weight named, read from the file in file order,
        exactly as a converted directory's model.safetensors holds it - but those in
        `bf16_names` (parameters held in bf16) whose blocks decode natively come as bf16,
        rounded from those fp32 values with no fp32 copy made (an 8B model's Q4_0
        embedding and head would take 2 GB each in fp32)."""
        layout = self.layout
        with open(self.path, "rb") as f:
            for entry in self.weights():
                hf_name = layout.hf_tensor_name(entry.name)
                if hf_name not in names:
                    continue
                data = _map_data(f, entry)
                # A norm's offset is undone in fp32 (convert_tensor): never narrowed first.
                narrow = hf_name in bf16_names and not (
                    layout.norm_offset and hf_name.endswith("norm.weight")
                )
                decoded = _decode_blocks(data, entry.kind, bf16=narrow)
                if decoded is not None:
                    data = None  # unmaps the tensor's pages
                dtype = torch.float32 if decoded is None else decoded.dtype
                name, weight = convert_tensor(
                    entry.as_reader_tensor(data), layout, self.config, dtype, decoded
                )
                del data, decoded
                yield name, weight

    def raw_blocks(self, hf_names: list[str]) -> dict[str, torch.Tensor]:
        """HF name -> the weight's raw blocks, one uint8 row per weight row, q/k rows in
        HF order (a row permutation moves whole rows of blocks: exact on the bytes)."""
        layout = self.layout
        by_name = {layout.hf_tensor_name(e.name): e for e in self.weights()}
        unpermute = unpermute_rows(self.config)
        raw = {}
        with open(self.path, "rb") as f:
            for name in hf_names:
                entry = by_name[name]
                rows = entry.dims[-1] if len(entry.dims) > 1 else 1
                data = torch.from_numpy(_map_data(f, entry).reshape(rows, -1))
                # A copy of its own: the mapping goes when this tensor's view does.
                raw[name] = unpermute(data, name).clone(memory_format=torch.contiguous_format)
                del data
        return raw


def _decode_blocks(data: np.ndarray, kind: str, *, bf16: bool = False) -> torch.Tensor | None:
    """The fp32 values of blocks in a format gguf_blocks decodes - bit for bit what
    `gguf.quants.dequantize` gives (tests check every bit), natively for Q4_0, Q4_1 and
    Q8_0 (kernels/gguf_dequantize.c) and in vectorized passes for the others, instead of
    gguf's per-row-group loop, which takes seconds for a 150k-token embedding at every
    start; None for other types (dequantized by gguf). With `bf16`, the native formats
    come as those values rounded to bf16, written directly (the others stay fp32)."""
    if kind not in BLOCK_FORMATS:
        return None
    rows = torch.from_numpy(data.reshape(-1, data.shape[-1]))
    if kind in gguf_dequantize.KINDS and gguf_dequantize.available():
        # one native pass, the same bits (gguf_dequantize.c), no temporaries
        dtype = torch.bfloat16 if bf16 else torch.float32
        return gguf_dequantize.dequantize_blocks(rows, kind, dtype)
    per_block, nbytes = BLOCK_FORMATS[kind]
    out = torch.empty(rows.shape[0], rows.shape[1] // nbytes * per_block)
    # A slice of rows at a time: the decode's temporaries (integers, fp32 products) stay
    # a few MB instead of several times the whole embedding.
    step = max(1, _DECODE_BYTES // max(1, 4 * out.shape[1]))
    for lo in range(0, rows.shape[0], step):
        out[lo : lo + step] = decode(rows[lo : lo + step], kind).dequantize()
    return out


def file_identity(path: str | os.PathLike) -> dict:
    """What tells a file's versions apart without reading it: size and mtime."""
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _map_data(f, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as the reader's `data` array (same dtype and shape), over a
    private mapping of just those bytes that lives as long as the array."""
    dtype, shape = entry.array_layout()
    if entry.nbytes == 0:
        return np.empty(shape, dtype=dtype)
    start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
    # ACCESS_COPY: writable for torch.from_numpy, never written back to the file.
    mapping = mmap.mmap(
        f.fileno(), entry.offset + entry.nbytes - start, access=mmap.ACCESS_COPY, offset=start
    )
    array = np.frombuffer(
        mapping, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=entry.offset - start
    )
    return array.reshape(shape)
