"""Mixture-of-experts GGUF files as llama.cpp lays them out: each layer's experts stacked
one tensor per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps: [experts, out, in]
in torch's order) and the router as ffn_gate_inp. A random Qwen3-MoE written so, converted
and run, matches transformers on the same weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_models import build_hf_model
from model_fixtures import tiny_vocab, write_tiny_tokenizer
from safetensors.torch import load_file
from test_moe_models import Compared, prompts_for

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader.gguf_convert import convert_gguf
from tokenmill.engine.types.sampling_params import SamplingParams

# HF module path inside a layer -> llama.cpp's block name.
BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_qwen3_moe_gguf(model_dir, path, config, quant_type: str) -> dict[str, np.ndarray]:
    """The checkpoint in `model_dir` as llama.cpp's converter writes a qwen3moe GGUF (its
    2-D and 3-D weights in `quant_type`); returns the GGUF tensors as float32 after
    quantization, by GGUF name."""
    tensors = load_file(model_dir / "model.safetensors")
    tokens, types = tiny_vocab()
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_vocab_size(len(tokens))
    write_tiny_tokenizer(writer, tokens, types)

    arrays = {}
    for name, tensor in tensors.items():
        if name in TOP_NAMES:
            arrays[TOP_NAMES[name]] = tensor.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:
            continue
        module = rest.removesuffix(".weight")
        arrays[f"blk.{layer}.{BLOCK_NAMES[module]}.weight"] = tensor.numpy()
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for hf, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stack = [tensors[f"{prefix}.{e}.{hf}.weight"] for e in range(config.num_experts)]
            arrays[f"blk.{layer}.ffn_{ours}_exps.weight"] = torch.stack(stack).numpy()

    qtype = gguf.GGMLQuantizationType[quant_type]
    stored = {}
    for name, array in arrays.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or "norm" in name:
            writer.add_tensor(name, array)
            stored[name] = array
        else:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(data, qtype).reshape(array.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("quant_type", ["F32", "Q8_0"])
def test_qwen3_moe_gguf_matches_transformers(quant_type, tmp_path):
    """Converted from its GGUF, the model answers as transformers does with the weights
    the GGUF holds (dequantized, for Q8_0)."""
    vocab = len(tiny_vocab()[0])
    hf = build_hf_model(
        "qwen3_moe",
        tmp_path / "hf",
        vocab_size=vocab,
        mlp_only_layers=[],  # llama.cpp's qwen3moe has experts in every layer
        num_hidden_layers=2,
        moe_intermediate_size=64,  # Q8_0 blocks of 32
    )
    gguf_path = tmp_path / "model.gguf"
    stored = write_qwen3_moe_gguf(tmp_path / "hf", gguf_path, hf.config, quant_type)
    # transformers' model with the stored (quantized) weights
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            mlp = hf.model.layers[layer].mlp
            gate = torch.from_numpy(stored[f"blk.{layer}.ffn_gate_exps.weight"])
            up = torch.from_numpy(stored[f"blk.{layer}.ffn_up_exps.weight"])
            mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            mlp.experts.down_proj.copy_(
                torch.from_numpy(stored[f"blk.{layer}.ffn_down_exps.weight"])
            )
            attn = hf.model.layers[layer].self_attn
            for module, name in (
                (attn.q_proj, "attn_q"),
                (attn.k_proj, "attn_k"),
                (attn.v_proj, "attn_v"),
                (attn.o_proj, "attn_output"),
                (mlp.gate, "ffn_gate_inp"),
            ):
                module.weight.copy_(torch.from_numpy(stored[f"blk.{layer}.{name}.weight"]))
        hf.model.embed_tokens.weight.copy_(torch.from_numpy(stored["token_embd.weight"]))
        hf.lm_head.weight.copy_(torch.from_numpy(stored["output.weight"]))

    out_dir = convert_gguf(gguf_path, tmp_path / "converted", dtype=torch.float32)
    llm = LLM(str(out_dir), dtype="float32", block_size=4, max_num_batched_tokens=16)
    prompts = [[t % vocab for t in p] for p in prompts_for(seed=3)]
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    compared = Compared()
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    compared.assert_mostly_compared()
