"""GGUF -> HF-layout conversion: synthetic GGUFs value for value, the real SmolLM2 against
transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import (  # noqa: E402
    converted_smollm2_dir,
    llama3_rope_freqs,
    llama_cpp_permute,
    smollm2_gguf_path,
    write_tiny_gguf,
)

from tokenmill.engine.loader.gguf_convert import (  # noqa: E402
    CONVERSION_RECORD,
    convert_gguf,
    hf_tensor_name,
    unpermute_qk,
)
from tokenmill.engine.loader.model_files import ModelFilesError  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ONCE_UPON_A_TIME = (
    ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and"
    " bustling streets. But as"
)


def _smollm2_gguf() -> Path:
    try:
        return smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(num_heads):
    head_dim = 8
    weight = torch.randn(num_heads * head_dim, 5)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, num_heads), weight)
    bias = torch.arange(num_heads * head_dim, dtype=torch.float32)
    permuted_bias = torch.from_numpy(llama_cpp_permute(bias.numpy(), num_heads))
    assert torch.equal(unpermute_qk(permuted_bias, num_heads), bias)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert (
        hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_tiny_f32_round_trip_is_exact(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", num_heads=4, num_kv_heads=2)
    out = convert_gguf(tiny.path, tmp_path / "out", dtype=torch.float32)

    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(tiny.hf_tensors)  # tied: no lm_head written
    for name, original in tiny.hf_tensors.items():
        assert torch.equal(tensors[name], original), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["hidden_size"], config["head_dim"], config["vocab_size"]) == (64, 16, 265)
    assert config["torch_dtype"] == "float32"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    record = json.loads((out / CONVERSION_RECORD).read_text())
    assert record["gguf_tensor_types"] == {"F32": len(tiny.hf_tensors)}


def test_default_dtype_keeps_every_value_and_untied_head_is_kept(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", tie_word_embeddings=False)
    out = convert_gguf(tiny.path, tmp_path / "out")
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert torch.equal(tensors["lm_head.weight"], tiny.hf_tensors["lm_head.weight"])
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(tensors[q], tiny.hf_tensors[q])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    ("quant_type", "tolerance"), [("F16", 1e-4), ("Q8_0", 2e-3), ("Q4_1", 3e-2)]
)
def test_quantized_tensors_dequantize_near_originals(tmp_path, quant_type, tolerance):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type=quant_type)
    tensors = load_file(
        convert_gguf(tiny.path, tmp_path / "out", dtype=torch.float32) / "model.safetensors"
    )
    for name, original in tiny.hf_tensors.items():
        assert (tensors[name] - original).abs().max().item() < tolerance, name


@pytest.mark.parametrize("quant_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensors_use_gguf_dequantize(tmp_path, quant_type):
    # gguf-py cannot quantize K-quants, so write raw blocks with zero scales and random
    # quants and check the converter puts gguf's own dequantization in the right shape.
    qtype = gguf.GGMLQuantizationType[quant_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 8, 2 * block_size
    raw = np.random.default_rng(0).integers(
        0, 256, (rows, cols // block_size * type_size), np.uint8
    )
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    from tokenmill.engine.loader.gguf_convert import convert_tensors

    reader = gguf.GGUFReader(tmp_path / "k.gguf")
    tensors = convert_tensors(reader, {"model_type": "llama"}, torch.float32)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    assert expected.shape == (rows, cols)
    assert torch.equal(tensors["model.layers.0.self_attn.v_proj.weight"], expected)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # head_dim 64 and theta 500000 put several frequencies in each of the three regimes.
    freqs = llama3_rope_freqs(64, 500000.0, factor=32.0)
    tiny = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        rope_theta=5e5,
        rope_freqs=freqs,
    )
    out = convert_gguf(tiny.path, tmp_path / "out", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in load_file(out / "model.safetensors")
    # transformers' llama3 rope from our config gives llama.cpp's scaled frequencies.
    hf_config = transformers.LlamaConfig(**config)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(inv_freq, base / torch.from_numpy(freqs))


def test_unknown_rope_freqs_are_refused(tmp_path):
    freqs = llama3_rope_freqs(16, 10000.0, factor=8.0, high_freq_factor=2.0)
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", rope_freqs=freqs)
    with pytest.raises(ValueError, match="rope_freqs do not match Llama 3 rope scaling"):
        convert_gguf(tiny.path, tmp_path / "out")


def test_unsupported_architecture_is_refused_before_writing(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", architecture="phi3")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        convert_gguf(tiny.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_llama_file_with_experts_is_mixtral():
    from tokenmill.engine.models import gguf_layout

    assert gguf_layout("llama").hf_architecture == "LlamaForCausalLM"
    assert gguf_layout("llama", num_experts=0).hf_architecture == "LlamaForCausalLM"
    mixtral = gguf_layout("llama", num_experts=8)
    assert (mixtral.hf_architecture, mixtral.permuted_qk) == ("MixtralForCausalLM", True)
    assert mixtral.hf_tensor_name("blk.2.ffn_up_exps.weight") == (
        "model.layers.2.mlp.experts.up_proj.weight"
    )
    assert gguf_layout("olmoe", num_experts=64).hf_architecture == "OlmoeForCausalLM"
    with pytest.raises(ValueError, match="has no known HF name"):
        gguf_layout("llama").hf_tensor_name("blk.2.ffn_up_exps.weight")


def test_refuses_non_empty_output_dir(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="non-empty"):
        convert_gguf(tiny.path, tmp_path / "out")


def test_tiny_tokenizer_matches_transformers_gguf_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenmill.engine.loader.tokenizer import Tokenizer

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    ours = Tokenizer.from_dir(convert_gguf(tiny.path, tmp_path / "out"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["the thin theme", "<|im_start|>user\nin<|im_end|>", "<think>x</think>", "é 🎉"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


# --- the real model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    _smollm2_gguf()
    return converted_smollm2_dir()


def test_smollm2_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    size = (smollm2_dir / "model.safetensors").stat().st_size
    assert 535e6 < size < 545e6  # 134.5 M parameters in fp32: the GGUF's values, exactly


def test_smollm2_attention_weights_equal_transformers_processing(smollm2_dir):
    # The cheap version of the test below: transformers' own llama q/k processing on the
    # real tensors of one layer (its full loader takes ~12 s to read this file).
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(_smollm2_gguf())
    wanted = {
        "blk.7.attn_q.weight": "model.layers.7.self_attn.q_proj.weight",
        "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
        "blk.7.ffn_down.weight": "model.layers.7.mlp.down_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
    }
    ours = load_file(smollm2_dir / "model.safetensors")
    types = {}
    for tensor in reader.tensors:
        if tensor.name in wanted:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            expected = processor.process(weights=weights, name=tensor.name).weights
            expected = torch.from_numpy(np.array(expected, dtype=np.float32))
            assert torch.equal(ours[wanted[tensor.name]], expected), tensor.name
            types[tensor.name] = tensor.tensor_type.name
    assert types == {
        "blk.7.attn_q.weight": "Q4_1",
        "blk.7.attn_k.weight": "Q4_1",
        "blk.7.ffn_down.weight": "Q4_1",
        "token_embd.weight": "Q8_0",
    }


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = _smollm2_gguf()
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):  # only used for its parameter names
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    ours = load_file(smollm2_dir / "model.safetensors")
    assert set(ours) == set(reference["tensors"])
    for name, tensor in reference["tensors"].items():
        # Same dequantization and q/k unpermutation, stored exactly.
        assert torch.equal(ours[name], tensor.float()), name


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers_on_gguf(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = _smollm2_gguf()
    # transformers' from_pretrained(gguf_file=...) insists on `accelerate`, which the
    # project does not install; this is the same GGUF loader without device placement.
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference)
    missing, unexpected = reference.load_state_dict(state["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embeddings
    reference.tie_weights()
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)

    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)[0, 4:]
        got = ours.generate(prompt, max_new_tokens=20, do_sample=False)[0, 4:]
    assert got.tolist() == expected.tolist()
    assert tokenizer.decode(got) == ONCE_UPON_A_TIME
