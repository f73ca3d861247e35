"""A scale model's GGUF: the same values as its safetensors checkpoint, as tokenmill's own
GGUF reader reads them back; quantized formats within their rounding; MoE refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from tokenmill.bench.scale_build import build_scale_model
from tokenmill.bench.scale_gguf import scale_gguf_path, write_scale_gguf
from tokenmill.engine import resolve_model

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 50_000,  # above the tokenizer's 49,152: the token list is padded
}


def _build(name: str, tmp_path, dtype: str = "float32"):
    overrides = {k: v for k, v in _TINY.items() if not (name == "qwen2.5-1.5b" and k == "head_dim")}
    return build_scale_model(
        name, num_layers=2, overrides=overrides, dtype=dtype, out_dir=tmp_path / name
    )


# Each GGUF read parses SmolLM2's 49,152 tokens in Python (seconds): llama, with its
# reordered q/k rows and rope_freqs, is the default case.
@pytest.mark.parametrize(
    "name", ["llama-3.1-8b", pytest.param("qwen2.5-1.5b", marks=pytest.mark.slow)]
)
def test_f32_gguf_reads_back_as_the_checkpoint(name, tmp_path):
    # llama: q/k rows reordered for llama.cpp and Llama 3's rope_freqs; qwen2: q/k/v biases.
    model_dir = _build(name, tmp_path)
    path = write_scale_gguf(model_dir, "F32", tmp_path / "m.gguf")
    converted = resolve_model(path)  # tokenmill's GGUF reader: undoes llama's reorder
    with (
        safe_open(str(converted / "model.safetensors"), "pt") as ours,
        safe_open(str(model_dir / "model.safetensors"), "pt") as original,
    ):
        assert set(ours.keys()) == set(original.keys())
        for key in original.keys():
            assert torch.equal(ours.get_tensor(key), original.get_tensor(key)), key
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 50_000
    assert bytes(tokens.parts[tokens.data[-1]]) == b"[PAD49999]"
    assert bytes(tokens.parts[tokens.data[2]]) == b"<|im_end|>"  # SmolLM2's own ids
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 48_900
    names = {t.name for t in reader.tensors}
    assert ("rope_freqs.weight" in names) == (name == "llama-3.1-8b")


@pytest.mark.parametrize("fmt", ["Q4_0", pytest.param("Q8_0", marks=pytest.mark.slow), "BF16"])
def test_quantized_gguf_within_its_rounding(fmt, tmp_path):
    model_dir = _build("llama-3.1-8b", tmp_path, dtype="bfloat16")
    path = write_scale_gguf(model_dir, fmt, tmp_path / f"m.{fmt}.gguf")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == fmt
    assert tensors["blk.1.ffn_norm.weight"].tensor_type.name == "F32"
    down = tensors["blk.1.ffn_down.weight"]
    values = gguf.quants.dequantize(down.data, down.tensor_type).reshape(64, 96)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.down_proj.weight").float().numpy()
    error = np.abs(values - want).max()
    # per block of 32: Q8_0 rounds to amax/127, Q4_0 to amax/8 (values ~ 0.02 * N(0, 1))
    bound = {"Q8_0": 0.1 / 127, "Q4_0": 0.1 / 8, "BF16": 0.0}[fmt]
    assert error <= bound, error


def test_moe_and_unknown_formats_are_refused_by_name(tmp_path):
    moe = build_scale_model(
        "olmoe-1b-7b", num_layers=1, out_dir=tmp_path / "moe",
        overrides={"hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                   "vocab_size": 49_152},
    )  # fmt: skip
    with pytest.raises(ValueError, match="no GGUF layout for olmoe here"):
        write_scale_gguf(moe, "BF16", tmp_path / "moe.gguf")
    with pytest.raises(ValueError, match="unknown GGUF format 'Q5_K'"):
        write_scale_gguf(moe, "Q5_K", tmp_path / "moe.gguf")
    assert not (tmp_path / "moe.gguf").exists()


def test_the_gguf_is_written_once_beside_the_checkpoint(tmp_path):
    model_dir = _build("qwen2.5-1.5b", tmp_path, dtype="bfloat16")
    path = scale_gguf_path(model_dir)
    assert path == model_dir / "model.BF16.gguf"
    stamp = path.stat().st_mtime_ns
    assert scale_gguf_path(model_dir, "BF16").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in model_dir.glob("*.gguf")) == ["model.BF16.gguf"]
