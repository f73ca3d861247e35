"""Checkpoints as llm-compressor writes them: our test packer rewrites their tensors byte
for byte, and the engine over them computes what transformers computes on
compressed-tensors' own decompression of them - exactly for weights-only schemes, within
the activations' own rounding for W8A8.

No quantized weights are committed: the `llmcompressor_checkpoints` fixture rebuilds
llm-compressor's data-free W4A16_ASYM, W8A8 and FP8_DYNAMIC checkpoints of a seeded random
Llama (FP8_DYNAMIC's own tests: test_fp8_checkpoints.py) with compressed-tensors, the package llm-compressor writes them with - its preset
schemes, min-max scales of the bf16 weights per 128-input group (W4A16_ASYM) or per
output channel (W8A8's int8, FP8_DYNAMIC's fp8), and its compressors
(reference_quantizers.write_llmcompressor_checkpoint lists the steps). Data-free, those
are all llm-compressor computes, and every tensor was checked to equal, byte for byte,
what llm-compressor 0.14 wrote from the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from compressed_tensors.compressors.naive_quantized import (
    FloatQuantizationCompressor,
    IntQuantizationCompressor,
    NaiveQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from hf_models import hf_prompt_logprobs, make_engine, run_all, save_char_tokenizer
from quantized_checkpoints import compressed_tensors_layer
from safetensors.torch import load_file

from tokenmill.cli import main
from tokenmill.engine.kernels import int8_linear
from tokenmill.engine.quant.checkpoint.compressed_tensors import CompressedTensors
from tokenmill.engine.quant.checkpoint.layers import ExactIntLinear
from tokenmill.engine.quant.int8 import Int8Linear
from tokenmill.engine.types.sampling_params import SamplingParams

PROMPTS = [[3, 5, 7, 9, 11, 4, 6, 30, 31], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3, 60, 2]]
_COMPRESSORS = {
    "pack-quantized": PackedQuantizationCompressor,
    "int-quantized": IntQuantizationCompressor,
    "float-quantized": FloatQuantizationCompressor,
    "naive-quantized": NaiveQuantizationCompressor,
}


def read(model_dir: Path):
    raw = json.loads((model_dir / "config.json").read_text())
    settings = raw["quantization_config"]
    group = settings["config_groups"]["group_0"]
    tensors = load_file(model_dir / "model.safetensors")
    layers = sorted({n.rpartition(".")[0] for n in tensors if n.endswith("weight_scale")})
    return raw, settings, group, tensors, layers


@pytest.mark.parametrize("name", ["W4A16_ASYM", "W8A8"])
def test_our_packer_rewrites_llm_compressors_tensors_byte_for_byte(name, llmcompressor_checkpoints):
    raw, settings, group, tensors, layers = read(llmcompressor_checkpoints[name])
    reader = CompressedTensors().parse(settings)
    assert len(layers) == 7
    for layer in layers:
        scheme = reader.scheme(layer)
        mine = {n.rpartition(".")[2]: t for n, t in tensors.items() if n.startswith(layer + ".")}
        n, k = mine["weight_shape"].tolist() if "weight_shape" in mine else mine["weight"].shape
        decoded = reader.decode(scheme, mine, n, k)
        again = compressed_tensors_layer(decoded, group["format"])
        assert set(again) == set(mine), layer
        for suffix, tensor in again.items():
            assert tensor.dtype == mine[suffix].dtype and torch.equal(tensor, mine[suffix]), suffix


def reference_model(model_dir: Path, *, activations: bool = False):
    """transformers' Llama holding compressed-tensors' own decompression of the checkpoint
    (scales given in fp32, so every value is (q - zero) * scale exactly), in fp32; with
    `activations`, each quantized layer's input goes through compressed-tensors' dynamic
    per-token fake quantization first, as its forward does."""
    raw, settings, group, tensors, layers = read(model_dir)
    config = transformers.LlamaConfig(
        **{k: v for k, v in raw.items() if k != "quantization_config"}
    )
    model = transformers.LlamaForCausalLM(config).eval()
    scheme = QuantizationScheme(
        **{k: group[k] for k in ("targets", "weights", "input_activations")}
    )
    state = {n: t.float() for n, t in tensors.items() if not n.startswith(tuple(layers))}
    for layer in layers:
        mine = {n.rpartition(".")[2]: t for n, t in tensors.items() if n.startswith(layer + ".")}
        mine["weight_scale"] = mine["weight_scale"].float()
        state[f"{layer}.weight"] = _COMPRESSORS[group["format"]].decompress(mine, scheme)["weight"]
    model.load_state_dict(state, strict=True)
    if activations:
        for layer in layers:
            module = model.get_submodule(layer)
            module.register_forward_pre_hook(_fake_quantize_input(scheme.input_activations))
    return model


def _fake_quantize_input(args):
    def hook(module, inputs):
        (x,) = inputs
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return (fake_quantize(x, scale, zero, args),)

    return hook


def engine_logprobs(model_dir: Path):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    engine = make_engine(model_dir)
    outputs = run_all(engine, PROMPTS, params)
    return engine, [
        [out.prompt_logprobs[i + 1][t] for i, t in enumerate(p[1:])]
        for p, out in zip(PROMPTS, outputs)
    ]


def reference_logprobs(model) -> list[list[float]]:
    return [[float(row[t]) for row, t in zip(hf_prompt_logprobs(model, p), p[1:])] for p in PROMPTS]


def test_w4a16_asym_is_transformers_on_the_decompressed_weights(llmcompressor_checkpoints):
    model_dir = llmcompressor_checkpoints["W4A16_ASYM"]
    engine, ours = engine_logprobs(model_dir)
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, ExactIntLinear)
    theirs = reference_logprobs(reference_model(model_dir))
    worst = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))
    assert worst < 1e-3, worst


def test_w8a8_is_transformers_with_compressed_tensors_activation_rounding(
    llmcompressor_checkpoints,
):
    """The int8 kernels round each token's activations as compressed-tensors does for a
    checkpoint's layers (max|x| / 127.5, codes -128..127, a true division): ours equals
    transformers with that rounding to float noise, where the int8 mode's own rounding
    (max|x| / 127, -127..127) is 0.057 away; the rounding itself moves them by 0.063."""
    model_dir = llmcompressor_checkpoints["W8A8"]
    engine, ours = engine_logprobs(model_dir)
    down = engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int8Linear)
    assert down.rounding == ("full" if int8_linear.takes_full_rounding() else "symmetric")
    with_rounding = reference_logprobs(reference_model(model_dir, activations=True))
    without = reference_logprobs(reference_model(model_dir))
    ours_vs_ct = max(abs(a - b) for x, y in zip(ours, with_rounding) for a, b in zip(x, y))
    scheme_error = max(abs(a - b) for x, y in zip(without, with_rounding) for a, b in zip(x, y))
    print(
        f"\nW8A8 prompt logprobs: ours vs compressed-tensors {ours_vs_ct:.2e}, "
        f"compressed-tensors' activation rounding itself {scheme_error:.5f}"
    )
    assert scheme_error > 0.01
    if down.rounding == "full":
        assert ours_vs_ct < 1e-4
    else:  # plain AVX2: the int8 mode's rounding, held within the scheme's own error
        assert ours_vs_ct < scheme_error


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "W4A16_ASYM",
            {
                "quantization": "compressed-tensors pack-quantized, W4A16 g128, zero points",
                "weight bits": "4",
                "group size": "128",
                "kernels": "W4A16 g128, zero points: bf16: PyTorch's int4 kernel (Int4Linear)",
            },
        ),
        (
            "W8A8",
            {
                "quantization": "compressed-tensors int-quantized, W8A8 per-channel",
                "weight bits": "8",
                "group size": "per-channel",
                "kernels": "W8A8 per-channel: int8 kernels (",
            },
        ),
    ],
)
def test_models_info_names_the_format_bits_group_size_and_kernels(
    name, expected, tmp_path, llmcompressor_checkpoints
):
    model_dir = tmp_path / name
    shutil.copytree(llmcompressor_checkpoints[name], model_dir)
    save_char_tokenizer(model_dir)
    result = CliRunner().invoke(main, ["models", "info", str(model_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    fields = dict(line.split(":", 1) for line in result.output.splitlines())
    fields = {key: value.strip() for key, value in fields.items()}
    # The model's own parameters, not the stored elements (8 codes per int32 in W4A16):
    # embeddings and lm_head, q and o, k and v (2 heads of 32), gate, up and down, 3 norms.
    count = 2 * 64 * 128 + 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 3 * 128
    assert fields["parameters"] == f"164.2K ({count:,})"
    for key, value in expected.items():
        if key == "kernels":
            assert fields[key].startswith(value), fields[key]
        else:
            assert fields[key] == value


def test_models_info_of_a_format_not_read_says_why(tmp_path, llmcompressor_checkpoints):
    model_dir = tmp_path / "NVFP4"
    shutil.copytree(llmcompressor_checkpoints["FP8_DYNAMIC"], model_dir)
    save_char_tokenizer(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    settings = raw["quantization_config"]
    settings["format"] = settings["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    (model_dir / "config.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(main, ["models", "info", str(model_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = dict(line.split(":", 1) for line in result.output.splitlines())
    assert lines["quantization"].strip().startswith("compressed-tensors, format nvfp4-pack")
    assert "nvfp4-pack-quantized - 4-bit float weights are not read" in lines["not loadable"]


def test_a_job_on_a_quantized_checkpoint_names_its_quantization_in_the_ledger(
    tmp_path, llmcompressor_checkpoints
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.output import read_ledger, read_ledger_dataset

    model_dir = tmp_path / "W4A16_ASYM"
    shutil.copytree(llmcompressor_checkpoints["W4A16_ASYM"], model_dir)
    save_char_tokenizer(model_dir)
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["abc", "hello"]}), source)
    out = tmp_path / "out"
    ledger = run_job(
        str(source),
        str(out),
        model=str(model_dir),
        prompt_column="text",
        id_column="id",
        max_tokens=2,
        dtype="float32",
        engine_options={"kv_cache_memory": 8 << 20},
    )
    named = "compressed-tensors pack-quantized, W4A16 g128, zero points"
    assert (ledger.rows_ok, ledger.quantization) == (2, named)
    assert read_ledger(str(out)).quantization == named
    assert read_ledger_dataset(str(out / "ledger"))["quantization"].to_pylist() == [named]
