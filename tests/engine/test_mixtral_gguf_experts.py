"""Mixtral in llama.cpp's older GGUF layout, one tensor per expert (blk.N.ffn_gate.E.weight,
ffn_up.E, ffn_down.E) where today's converter stacks them (ffn_gate_exps ...): the same
random weights written both ways run to the same logprobs, and a missing expert is
refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hf_models import make_engine, run_all
from model_fixtures import tiny_vocab, write_tiny_tokenizer

from tokenmill.engine.loader.model_files import model_info, resolve_model
from tokenmill.engine.types.sampling_params import SamplingParams

HIDDEN, FF, LAYERS, HEADS, KV_HEADS, EXPERTS = 64, 96, 2, 4, 2, 4
PROMPTS = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3]]


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    """A random Mixtral by llama.cpp's stacked names, torch's [out, in] order."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    head_dim = HIDDEN // HEADS

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    arrays = {
        "token_embd.weight": rand(vocab, HIDDEN),
        "output_norm.weight": 1 + rand(HIDDEN),
        "output.weight": rand(vocab, HIDDEN),
    }
    for layer in range(LAYERS):
        blk = f"blk.{layer}"
        arrays[f"{blk}.attn_q.weight"] = rand(HEADS * head_dim, HIDDEN)
        arrays[f"{blk}.attn_k.weight"] = rand(KV_HEADS * head_dim, HIDDEN)
        arrays[f"{blk}.attn_v.weight"] = rand(KV_HEADS * head_dim, HIDDEN)
        arrays[f"{blk}.attn_output.weight"] = rand(HIDDEN, HEADS * head_dim)
        arrays[f"{blk}.attn_norm.weight"] = 1 + rand(HIDDEN)
        arrays[f"{blk}.ffn_norm.weight"] = 1 + rand(HIDDEN)
        arrays[f"{blk}.ffn_gate_inp.weight"] = rand(EXPERTS, HIDDEN) * 20
        arrays[f"{blk}.ffn_gate_exps.weight"] = rand(EXPERTS, FF, HIDDEN)
        arrays[f"{blk}.ffn_up_exps.weight"] = rand(EXPERTS, FF, HIDDEN)
        arrays[f"{blk}.ffn_down_exps.weight"] = rand(EXPERTS, HIDDEN, FF)
    return arrays


def write_mixtral_gguf(path, quant_type: str, *, per_expert: bool, leave_out: str = ""):
    """The weights as a `llama` GGUF with experts (Mixtral), the experts stacked or (per
    _expert) one tensor each as llama.cpp's converter once wrote them; `leave_out`: a
    tensor name not written."""
    tokens, types = tiny_vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_vocab_size(len(tokens))
    write_tiny_tokenizer(writer, tokens, types)
    arrays = {}
    for name, array in _weights().items():
        if per_expert and name.endswith("_exps.weight"):
            stem = name.removesuffix("_exps.weight")
            arrays.update({f"{stem}.{e}.weight": array[e] for e in range(EXPERTS)})
        else:
            arrays[name] = array
    qtype = gguf.GGMLQuantizationType[quant_type]
    for name, array in arrays.items():
        if name == leave_out:
            continue
        if array.ndim == 1 or "norm" in name or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("quant_type", "quantization"), [("F32", None), ("Q8_0", None), ("Q8_0", "int8")]
)
def test_one_tensor_per_expert_runs_as_the_stacked_layout(quant_type, quantization, tmp_path):
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    runs = {}
    for per_expert in (False, True):
        path = write_mixtral_gguf(
            tmp_path / f"m{int(per_expert)}.gguf", quant_type, per_expert=per_expert
        )
        mapped = resolve_model(path, cache_root=tmp_path / f"cache{int(per_expert)}")
        info = model_info(path)
        runs[per_expert] = (
            run_all(make_engine(mapped, quantization=quantization), PROMPTS, params),
            (info.architecture, info.num_parameters, info.num_active_parameters),
        )
    (stacked, stacked_info), (split, split_info) = runs[False], runs[True]
    assert split_info == stacked_info
    assert stacked_info[0] == "gguf:llama"
    assert stacked_info[2] < stacked_info[1]  # two of four experts active
    for out, ref in zip(split, stacked):
        assert out.token_ids == ref.token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs
        assert out.prompt_logprobs == ref.prompt_logprobs


def test_a_missing_expert_is_refused_by_name(tmp_path):
    path = write_mixtral_gguf(
        tmp_path / "m.gguf", "F32", per_expert=True, leave_out="blk.1.ffn_up.2.weight"
    )
    with pytest.raises(
        ValueError,
        match=r"missing weights: model\.layers\.1\.mlp\.experts\.gate_up_proj\[1\] of expert 2$",
    ):
        mapped = resolve_model(path, cache_root=tmp_path / "cache")
        make_engine(mapped)


def test_one_experts_name_maps_into_its_stack_only_where_the_layout_has_experts():
    from tokenmill.engine.models import gguf_layout

    mixtral = gguf_layout("llama", num_experts=8)
    assert mixtral.hf_tensor_name("blk.3.ffn_gate.5.weight") == (
        "model.layers.3.mlp.experts.5.gate_proj.weight"
    )
    assert mixtral.hf_tensor_name("blk.0.ffn_down.7.weight") == (
        "model.layers.0.mlp.experts.7.down_proj.weight"
    )
    for name in ("blk.0.ffn_gate.x.weight", "blk.0.attn_q.1.weight", "blk.0.ffn_up.1.bias.x"):
        with pytest.raises(ValueError, match="has no known HF name"):
            mixtral.hf_tensor_name(name)
    with pytest.raises(ValueError, match="has no known HF name"):
        gguf_layout("llama").hf_tensor_name("blk.0.ffn_up.1.weight")
