"""A scale model's GGUF: the same values as its safetensors checkpoint, as tokenmill's own
GGUF reader reads them back; quantized formats within their rounding; MoE experts stacked
as llama.cpp lays them out, and what llama.cpp's MoE graphs do not compute refused."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from tokenmill.bench.scale_build import build_scale_model
from tokenmill.bench.scale_gguf import scale_gguf_path, write_scale_gguf
from tokenmill.bench.scale_shapes import SHAPES
from tokenmill.engine import resolve_model
from tokenmill.engine.loader.gguf_tensors import GGUFTensors

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
    _assert_reads_back(converted, model_dir)
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


_TINY_MOE = {
    "hidden_size": 64,
    "intermediate_size": 64,  # OLMoE's experts: Q4_0 blocks of 32 along down's rows
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 49_152,
}


def _build_moe(name: str, tmp_path, dtype: str = "float32"):
    overrides = {k: v for k, v in _TINY_MOE.items() if k in SHAPES[name]}
    if name == "mixtral-8x7b":  # num_local_experts; experts intermediate_size wide
        overrides["num_local_experts"] = _TINY_MOE["num_experts"]
    if name == "olmoe-1b-7b":  # llama.cpp's olmoe: q and its norm are hidden_size wide
        overrides["num_key_value_heads"] = 4
    return build_scale_model(
        name, num_layers=2, overrides=overrides, dtype=dtype, out_dir=tmp_path / name
    )


def _stacked(f, layer: int, projection: str, num_experts: int) -> torch.Tensor:
    return torch.stack(
        [
            f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{projection}_proj.weight")
            for e in range(num_experts)
        ]
    )


@pytest.mark.parametrize(
    "name", ["olmoe-1b-7b", pytest.param("qwen3-30b-a3b", marks=pytest.mark.slow)]
)
def test_moe_gguf_reads_back_as_the_checkpoint_and_runs_the_same(name, tmp_path):
    """Experts stacked per projection, [experts, out, in] in torch's order; tokenmill's
    GGUF reader unstacks them into the same model: the same logits as the checkpoint."""
    from tokenmill.engine import LLM, SamplingParams

    model_dir = _build_moe(name, tmp_path)
    path = write_scale_gguf(model_dir, "F32", tmp_path / "m.gguf")
    arch = {"olmoe-1b-7b": "olmoe", "qwen3-30b-a3b": "qwen3moe"}[name]
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields[f"{arch}.expert_count"].contents() == 4
    assert reader.fields[f"{arch}.expert_used_count"].contents() == 2
    assert reader.fields[f"{arch}.expert_feed_forward_length"].contents() == 64
    tensors = {t.name: t for t in reader.tensors}
    # GGUF lists dims fastest first: gate/up {hidden, inter, experts}, down {inter, hidden, ...}
    assert tensors["blk.1.ffn_gate_exps.weight"].shape.tolist() == [64, 64, 4]
    assert tensors["blk.1.ffn_down_exps.weight"].shape.tolist() == [64, 64, 4]
    assert tensors["blk.1.ffn_gate_inp.weight"].shape.tolist() == [64, 4]
    norm_width = {"olmoe": 64, "qwen3moe": 16}[arch]  # OLMoE's over all heads, Qwen3's per head
    assert tensors["blk.0.attn_q_norm.weight"].shape.tolist() == [norm_width]
    assert not [n for n in tensors if ".experts." in n or "_proj" in n]

    converted = resolve_model(path)
    ours = _read_back(converted)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as original:
        stacks = {k for k in ours if ".experts." in k}
        assert stacks == {
            f"model.layers.{i}.mlp.experts.{p}_proj.weight"
            for i in range(2)
            for p in ("gate", "up", "down")
        }
        for key in stacks:
            layer, projection = int(key.split(".")[2]), key.split(".")[-2].removesuffix("_proj")
            assert torch.equal(ours[key], _stacked(original, layer, projection, 4)), key
        for key in set(ours) - stacks:
            assert torch.equal(ours[key], original.get_tensor(key)), key
    config = json.loads((converted / "config.json").read_text())
    assert config["norm_topk_prob"] == (arch == "qwen3moe")
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    prompts = [[5, 900, 31, 7000, 12, 44_000], [3, 3, 17, 256]]
    outputs = {}
    for label, source in (("checkpoint", model_dir), ("gguf", converted)):
        llm = LLM(str(source), dtype="float32", max_num_batched_tokens=32)
        outputs[label] = llm.generate(prompts, params)
    for ours, want in zip(outputs["gguf"], outputs["checkpoint"]):
        assert ours.outputs[0].token_ids == want.outputs[0].token_ids
        assert ours.prompt_logprobs == want.prompt_logprobs


# Q8_0 moves this tiny model's log-probs by about 5e-3 at most (measured on it).
Q8_0_LOGPROB_TOLERANCE = 2e-2


def _mixtral_stack(f, layer: int, projection: str) -> torch.Tensor:
    """Mixtral's experts of one projection (w1 gate, w3 up, w2 down), stacked."""
    w = {"gate": "w1", "up": "w3", "down": "w2"}[projection]
    return torch.stack(
        [
            f.get_tensor(f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight")
            for e in range(4)
        ]
    )


def _mixtral_outputs(sources: dict) -> dict:
    from tokenmill.engine import LLM, SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2
    )
    prompts = [[5, 900, 31, 7000, 12, 44_000], [3, 3, 17, 256]]
    outputs = {}
    for label, source in sources.items():
        llm = LLM(str(source), dtype="float32", max_num_batched_tokens=32)
        outputs[label] = llm.generate(prompts, params)
    return outputs


@pytest.mark.parametrize("fmt", ["F32", "Q8_0"])
def test_mixtral_gguf_is_a_llama_with_experts_read_into_mixtral(fmt, tmp_path):
    """llama.cpp writes Mixtral as `llama` with `llama.expert_count`, q/k rows permuted
    and the experts stacked; tokenmill reads it back into its Mixtral: F32 the checkpoint's
    values and outputs exactly, Q8_0 the file's dequantized values, within its rounding."""
    model_dir = _build_moe("mixtral-8x7b", tmp_path)
    path = write_scale_gguf(model_dir, fmt, tmp_path / f"m.{fmt}.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.expert_count"].contents() == 4
    assert reader.fields["llama.expert_used_count"].contents() == 2
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"].shape.tolist() == [64, 64, 4]
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type.name == fmt

    converted = resolve_model(path)
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    bound = {"F32": 0.0, "Q8_0": 0.1 / 127}[fmt]  # per block of 32: amax/127
    ours = _read_back(converted)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as original:
        for layer in range(2):
            for projection in ("gate", "up", "down"):
                key = f"model.layers.{layer}.mlp.experts.{projection}_proj.weight"
                got, want = ours[key], _mixtral_stack(original, layer, projection)
                stored = tensors[f"blk.{layer}.ffn_{projection}_exps.weight"]
                values = gguf.quants.dequantize(stored.data, stored.tensor_type)
                assert torch.equal(got, torch.from_numpy(values.copy()).reshape(got.shape))
                assert (got - want).abs().max() <= bound, key
            router = f"model.layers.{layer}.block_sparse_moe.gate.weight"
            got = ours[f"model.layers.{layer}.mlp.gate.weight"]
            assert torch.equal(got, original.get_tensor(router))
            # q/k rows back in HF order (llama.cpp permutes them as Llama's)
            q = f"model.layers.{layer}.self_attn.q_proj.weight"
            assert (ours[q] - original.get_tensor(q)).abs().max() <= bound

    outputs = _mixtral_outputs({"checkpoint": model_dir, "gguf": converted})
    for ours, want in zip(outputs["gguf"], outputs["checkpoint"]):
        if fmt == "F32":
            assert ours.outputs[0].token_ids == want.outputs[0].token_ids
            assert ours.prompt_logprobs == want.prompt_logprobs
            continue
        # Q8_0's rounding moves each prompt log-prob by far less than the 10.8 of a
        # uniform choice among 49,152 tokens, and not by nothing (the rounding is real).
        prompt = [
            abs(step[t] - want_step[t])
            for step, want_step in zip(ours.prompt_logprobs[1:], want.prompt_logprobs[1:])
            for t in want_step
            if t in step
        ]
        assert 0 < max(prompt) < Q8_0_LOGPROB_TOLERANCE, max(prompt)
        # Greedy tokens equal until the float model's top two are within that rounding
        # (a random model's choices are near ties), where either is right.
        for got, step in zip(ours.outputs[0].token_ids, want.outputs[0].logprobs):
            (first, top), (_, second) = sorted(step.items(), key=lambda kv: -kv[1])[:2]
            if got != first:
                assert top - second < 2 * Q8_0_LOGPROB_TOLERANCE, (top, second)
                break


@pytest.mark.parametrize("fmt", ["Q4_0", pytest.param("Q8_0", marks=pytest.mark.slow), "BF16"])
def test_moe_experts_within_their_format_rounding(fmt, tmp_path):
    model_dir = _build_moe("qwen3-30b-a3b", tmp_path, dtype="bfloat16")
    path = write_scale_gguf(model_dir, fmt, tmp_path / f"m.{fmt}.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert tensors["blk.0.ffn_up_exps.weight"].tensor_type.name == fmt
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"  # never quantized
    assert tensors["blk.0.attn_k_norm.weight"].tensor_type.name == "F32"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        router = f.get_tensor("model.layers.0.mlp.gate.weight").float().numpy()
        for projection in ("gate", "up", "down"):
            stored = tensors[f"blk.0.ffn_{projection}_exps.weight"]
            values = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(4, 64, 64)
            want = _stacked(f, 0, projection, 4).float().numpy()
            error = np.abs(values - want).max()
            bound = {"Q8_0": 0.1 / 127, "Q4_0": 0.1 / 8, "BF16": 0.0}[fmt]
            assert error <= bound, (projection, error)
    assert np.array_equal(tensors["blk.0.ffn_gate_inp.weight"].data, router)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("olmoe-1b-7b", "clip_qkv", 8.0, "llama.cpp's olmoe does not compute clip_qkv"),
        ("olmoe-1b-7b", "norm_topk_prob", True, "olmoe does not compute norm_topk_prob true"),
        ("qwen3-30b-a3b", "norm_topk_prob", False, "norm_topk_prob false"),
        ("qwen3-30b-a3b", "mlp_only_layers", [0], r"dense layers \(mlp_only_layers"),
        ("qwen3-30b-a3b", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
    ],
)
def test_what_llama_cpp_does_not_compute_is_refused_by_name(name, field, value, message, tmp_path):
    model_dir = _build_moe(name, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        write_scale_gguf(model_dir, "BF16", tmp_path / "moe.gguf")
    assert not (tmp_path / "moe.gguf").exists()


def test_unknown_formats_are_refused_by_name(tmp_path):
    model_dir = _build_moe("olmoe-1b-7b", tmp_path)
    with pytest.raises(ValueError, match="unknown GGUF format 'Q5_K'"):
        write_scale_gguf(model_dir, "Q5_K", tmp_path / "moe.gguf")
    assert not (tmp_path / "moe.gguf").exists()


def test_the_gguf_is_written_once_beside_the_checkpoint(tmp_path):
    model_dir = _build("qwen2.5-1.5b", tmp_path, dtype="bfloat16")
    path = scale_gguf_path(model_dir)
    assert path == model_dir / "model.BF16.gguf"
    stamp = path.stat().st_mtime_ns
    assert scale_gguf_path(model_dir, "BF16").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in model_dir.glob("*.gguf")) == ["model.BF16.gguf"]


def _read_back(converted) -> dict[str, torch.Tensor]:
    """Every tensor as the loader reads it from the GGUF the directory runs from."""
    tensors = GGUFTensors.open_dir(converted)
    return dict(tensors.iter_float({source.name for source in tensors.sources()}))


def _assert_reads_back(converted, model_dir) -> None:
    """The loader's tensors from the GGUF are the checkpoint's, each bit for bit."""
    tensors = GGUFTensors.open_dir(converted)
    names = {source.name for source in tensors.sources()}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as original:
        assert names == set(original.keys())
        for key, tensor in tensors.iter_float(names):
            assert torch.equal(tensor, original.get_tensor(key)), key
