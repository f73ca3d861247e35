"""The strict loader: every checkpoint tensor fills a parameter or is refused by name, before
any weight is read - safetensors (one file and sharded) and GGUF - with a short
allow-list of tensors that are safe to leave."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import build_hf_model, hf_greedy, make_engine, run_all, save_char_tokenizer
from model_fixtures import write_tiny_gguf
from safetensors.torch import load_file, save_file

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader import gguf_convert, weights
from tokenmill.engine.loader.gguf_convert import convert_gguf
from tokenmill.engine.loader.tensor_plan import UNUSED_TENSORS
from tokenmill.engine.types.sampling_params import SamplingParams

WEIGHTS = "model.safetensors"
PROMPT = [5, 17, 3, 99, 42, 7, 7, 61, 200, 12]


def rewrite(model_dir, edit) -> None:
    """Rewrite the model's one safetensors file with `edit(tensors)` applied."""
    tensors = load_file(model_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, model_dir / WEIGHTS, metadata={"format": "pt"})


def shard(model_dir, second: set[str]) -> None:
    """Split the model's weights in two files with an index, `second` in the latter."""
    tensors = load_file(model_dir / WEIGHTS)
    (model_dir / WEIGHTS).unlink()
    parts = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in second},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in second},
    }
    weight_map = {}
    for file, part in parts.items():
        save_file(part, model_dir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture
def no_weight_read(monkeypatch):
    """Make reading any tensor's bytes fail: a refusal must come from the headers."""

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights, "iter_tensors", read)


@pytest.mark.parametrize(
    ("extra", "shape"),
    [
        ("model.layers.0.mlp.down_proj.bias", (64,)),  # mlp_bias not set
        ("model.layers.1.self_attn.q_norm.weight", (16,)),  # Qwen3's, not Llama's
        ("model.layers.0.self_attn.o_proj.weight_scale", (64, 1)),  # a quantization's
        ("model.layers.2.mlp.up_proj.weight", (128, 64)),  # a layer too many
    ],
)
def test_a_tensor_with_no_place_is_refused_by_name(extra, shape, tmp_path, no_weight_read):
    build_hf_model("llama", tmp_path)
    save_char_tokenizer(tmp_path)
    rewrite(tmp_path, lambda t: t.update({extra: torch.randn(shape)}))
    with pytest.raises(ValueError, match=rf"LlamaForCausalLM has no place for: {extra}"):
        LLM(str(tmp_path), dtype="float32")


def test_sharded_checkpoints_are_checked_whole_before_any_read(tmp_path, no_weight_read):
    """The tensor with no place is in the second shard; nothing of the first is read."""
    build_hf_model("qwen2", tmp_path)
    save_char_tokenizer(tmp_path)
    extra = "model.layers.1.mlp.gate_proj.bias"
    rewrite(tmp_path, lambda t: t.update({extra: torch.randn(128)}))
    shard(tmp_path, {extra, "model.norm.weight"})
    with pytest.raises(ValueError, match=rf"Qwen2ForCausalLM has no place for: {extra}"):
        LLM(str(tmp_path), dtype="float32")


def test_missing_and_misshapen_weights_are_named_before_any_read(tmp_path, no_weight_read):
    build_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / WEIGHTS)
    rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights: model.layers.1.self_attn.qkv_proj"):
        make_engine(tmp_path)
    bad = tensors["model.layers.1.self_attn.k_proj.weight"][:16]
    rewrite(tmp_path, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": bad}))
    with pytest.raises(
        ValueError, match=r"k_proj.weight has shape \(16, 64\), expected \(32, 64\)"
    ):
        make_engine(tmp_path)


def test_the_allow_list_is_short_and_says_why():
    assert len(UNUSED_TENSORS) == 3
    assert all(len(entry.reason) > 40 for entry in UNUSED_TENSORS)


def test_allowed_tensors_are_left_and_the_model_is_unchanged(tmp_path):
    """Rotary inv_freq buffers, an lm_head beside tied embeddings and a vision tower: left,
    and the model answers as transformers' does."""
    hf = build_hf_model("llama", tmp_path, tie_word_embeddings=True)
    expected = hf_greedy(hf, PROMPT, 6)[0]

    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)
        tensors["lm_head.weight"] = torch.randn(256, 64)  # tied: the embedding is the head
        tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.randn(8, 8)
        tensors["multi_modal_projector.linear_1.weight"] = torch.randn(8, 8)

    rewrite(tmp_path, add)
    engine = make_engine(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert run_all(engine, [PROMPT], params)[0].token_ids == expected


def test_an_untied_lm_head_is_a_weight_not_an_allowed_leftover(tmp_path, no_weight_read):
    build_hf_model("llama", tmp_path, tie_word_embeddings=False)
    rewrite(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing weights: lm_head.weight"):
        make_engine(tmp_path)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.int8, "int8"),
        (torch.uint8, "uint8"),
        (torch.int32, "int32"),
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.float8_e5m2, "float8_e5m2"),
    ],
)
def test_integer_and_fp8_weights_without_a_quantization_config_are_refused(
    dtype, name, tmp_path, no_weight_read
):
    """A quantized weight read as plain numbers is a different model: named with its dtype."""
    build_hf_model("llama", tmp_path)
    target = "model.layers.0.self_attn.q_proj.weight"

    def quantize(tensors):
        tensors[target] = (tensors[target] * 100).to(dtype)
        tensors[target.replace("weight", "weight_scale")] = torch.full((64, 1), 0.01)

    rewrite(tmp_path, quantize)
    with pytest.raises(ValueError, match=rf"{target} \({name}\)"):
        make_engine(tmp_path)


def test_bert_leaves_its_position_ids_and_unused_pooler(tmp_path):
    """A bare encoder's checkpoint holds transformers' pooler and (older ones) the
    position_ids buffer: the model leaves both by its own rule, nothing else."""
    from pooling_models import build_encoder

    build_encoder("bert", tmp_path)
    names = set(load_file(tmp_path / WEIGHTS))
    assert {"pooler.dense.weight", "pooler.dense.bias"} <= names
    rewrite(tmp_path, lambda t: t.update({"embeddings.position_ids": torch.arange(64)[None]}))
    LLM(str(tmp_path), dtype="float32").embed("the cat")
    rewrite(tmp_path, lambda t: t.update({"encoder.layer.0.attention.self.rel_pos": torch.ones(3)}))
    with pytest.raises(ValueError, match="encoder.layer.0.attention.self.rel_pos"):
        LLM(str(tmp_path), dtype="float32")


def test_gguf_tensor_with_no_place_is_refused_before_dequantizing(tmp_path, monkeypatch):
    """A known llama.cpp name the architecture has no parameter for (q norm in a llama
    file): refused by both names before any tensor is dequantized or written."""
    extra = {"blk.1.attn_q_norm.weight": np.ones(16, dtype=np.float32)}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", extra_tensors=extra)

    def dequantize(*args, **kwargs):
        raise AssertionError("a tensor was dequantized")

    monkeypatch.setattr(gguf_convert, "dequantize", dequantize)
    message = r"no place for: blk.1.attn_q_norm.weight \(model.layers.1.self_attn.q_norm.weight\)"
    with pytest.raises(ValueError, match=message):
        convert_gguf(tiny.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_name_unknown_to_the_layout_is_refused_before_dequantizing(tmp_path, monkeypatch):
    extra = {"blk.0.ffn_gate_exps.weight": np.ones((4, 8), dtype=np.float32)}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", extra_tensors=extra)
    monkeypatch.setattr(gguf_convert, "dequantize", None)  # any call fails
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        convert_gguf(tiny.path, tmp_path / "out")


def test_gguf_llama_with_biases_loads_them(tmp_path):
    """llama.cpp's llama files may carry q/k/v/o and MLP biases: attention_bias and
    mlp_bias, every bias loaded where transformers' Llama has it."""
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", biases=True)
    model_dir = convert_gguf(tiny.path, tmp_path / "out")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["attention_bias"], config["mlp_bias"]) == (True, True)
    model = make_engine(model_dir).runner.model
    layer = model.model.layers[1]
    want = {n: t for n, t in tiny.hf_tensors.items() if n.startswith("model.layers.1.")}
    qkv = [want[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.bias, torch.cat(qkv))
    torch.testing.assert_close(
        layer.self_attn.o_proj.bias, want["model.layers.1.self_attn.o_proj.bias"]
    )
    gate_up = [want[f"model.layers.1.mlp.{p}_proj.bias"] for p in ("gate", "up")]
    torch.testing.assert_close(layer.mlp.gate_up_proj.bias, torch.cat(gate_up))
    torch.testing.assert_close(layer.mlp.down_proj.bias, want["model.layers.1.mlp.down_proj.bias"])
