"""An fp32 engine runs a GGUF's own values: every weight it loads equals what
`gguf.quants.dequantize` gives for the file's tensor, bit for bit (after undoing
llama.cpp's q/k permutation and norm offset, and slicing our fused projections)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import converted_smollm2_dir, smollm2_gguf_path  # noqa: E402

from tokenmill.engine.loader.gguf_convert import unpermute_qk  # noqa: E402
from tokenmill.engine.loader.model_files import ALIASES, alias_gguf_path, resolve_model  # noqa: E402
from tokenmill.engine.loader.weights import load_model  # noqa: E402
from tokenmill.engine.models import gguf_layout, load_config  # noqa: E402

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


@pytest.mark.slow
def test_gemma3_fp32_weights_are_the_gguf_values_bit_for_bit(tmp_path):
    try:
        gguf_path = alias_gguf_path(ALIASES["gemma3-270m"])
    except FileNotFoundError as error:
        pytest.skip(str(error))
    model_dir = resolve_model(gguf_path, cache_root=tmp_path)
    compared = check_exact(gguf_path, model_dir)
    assert compared == 2 + 18 * 13  # 13 tensors a layer: 7 projections, 4 norms, q/k norms
