"""Checkpoints quantized by other tools: each format a reader takes is read in its own
format; every other one is refused by name - method, format, and the nearest thing that
runs - before any weight is read; never loaded as plain numbers."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import build_hf_model, save_char_tokenizer
from safetensors.torch import load_file, save_file

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader import weights
from tokenmill.engine.quant.checkpoint_formats import check_checkpoint_quantization, describe
from tokenmill.engine.quant.int8 import Int8Linear

INT8 = "--quantization int8"
INT4 = "--quantization int4"


def compressed_tensors(fmt: str, weights: dict, activations: dict | None, **extra) -> dict:
    """A quantization_config as llm-compressor writes it (one scheme over every Linear but
    the lm_head)."""
    scheme = {
        "targets": ["Linear"],
        "weights": {
            "actorder": None,
            "block_structure": None,
            "dynamic": False,
            "group_size": None,
            "observer": "minmax",
            "observer_kwargs": {},
            "symmetric": True,
            **weights,
        },
        "input_activations": activations,
        "output_activations": None,
    }
    return {
        "config_groups": {"group_0": scheme},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "version": "0.10.2",
        **extra,
    }


TOKEN_ACTIVATIONS = {
    "dynamic": True,
    "num_bits": 8,
    "observer": None,
    "strategy": "token",
    "symmetric": True,
    "type": "int",
}
W8A8 = compressed_tensors(
    "int-quantized", {"num_bits": 8, "strategy": "channel", "type": "int"}, TOKEN_ACTIVATIONS
)

FORMATS = {
    "gptq-4bit": (
        {
            "bits": 4,
            "group_size": 128,
            "damp_percent": 0.01,
            "desc_act": False,
            "sym": True,
            "true_sequential": True,
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
        },
        ["quant_method gptq", "4-bit", "group_size 128", "format gptq"],
        INT4,
    ),
    "gptq-8bit-v2": (
        {"bits": 8, "group_size": 32, "quant_method": "gptq", "checkpoint_format": "gptq_v2"},
        ["quant_method gptq", "8-bit", "format gptq_v2"],
        INT8,
    ),
    "awq-gemm": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        },
        ["quant_method awq", "4-bit", "format gemm"],
        INT4,
    ),
    "compressed-tensors-w8a8": (
        W8A8,
        ["compressed-tensors", "format int-quantized", "W8A8 (int weights, int activations)"],
        INT8,
    ),
    "compressed-tensors-w4a16": (
        compressed_tensors(
            "pack-quantized",
            {"num_bits": 4, "strategy": "group", "group_size": 128, "type": "int"},
            None,
        ),
        ["compressed-tensors", "format pack-quantized", "W4A16 (int weights)"],
        INT4,
    ),
    "compressed-tensors-fp8-dynamic": (
        compressed_tensors(
            "float-quantized",
            {"num_bits": 8, "strategy": "channel", "type": "float"},
            {**TOKEN_ACTIVATIONS, "type": "float"},
        ),
        ["compressed-tensors", "format float-quantized", "W8A8 (float weights, float activations)"],
        INT8,
    ),
    "compressed-tensors-naive": (
        compressed_tensors(
            "naive-quantized", {"num_bits": 8, "strategy": "tensor", "type": "int"}, None
        ),
        ["format naive-quantized", "W8A16 (int weights)"],
        INT8,
    ),
    "compressed-tensors-nvfp4": (
        compressed_tensors(
            "nvfp4-pack-quantized",
            {"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "type": "float"},
            {"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "type": "float"},
        ),
        ["format nvfp4-pack-quantized", "W4A4 (float weights, float activations)"],
        INT4,
    ),
    "compressed-tensors-2of4-sparse": (
        compressed_tensors(
            "int-quantized",
            {"num_bits": 8, "strategy": "channel", "type": "int"},
            TOKEN_ACTIVATIONS,
            sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"},
        ),
        ["format int-quantized", "sparse"],
        INT8,
    ),
    "compressed-tensors-mixed-groups": (
        {
            **W8A8,
            "format": "mixed-precision",
            "config_groups": {
                "group_0": {**W8A8["config_groups"]["group_0"], "format": "int-quantized"},
                "group_1": {
                    "targets": ["re:.*mlp.down_proj"],
                    "format": "pack-quantized",
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 64,
                    },
                },
            },
        },
        ["int-quantized/pack-quantized", "W4A16 (int weights)/W8A8 (int weights, int activations)"],
        INT8,
    ),
    "fp8-block-wise": (
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
        ["quant_method fp8", "block-wise [128, 128]"],
        INT8,
    ),
    "bitsandbytes-nf4": (
        {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
        ["quant_method bitsandbytes", "nf4"],
        INT4,
    ),
    "bitsandbytes-int8": (
        {"quant_method": "bitsandbytes", "load_in_4bit": False, "load_in_8bit": True},
        ["quant_method bitsandbytes", "int8"],
        INT8,
    ),
    "mxfp4": (
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
        ["quant_method mxfp4"],
        INT4,
    ),
    "unknown-method": ({"quant_method": "hqq", "nbits": 4}, ["quant_method hqq"], INT4),
}


@pytest.mark.parametrize("settings, names, nearest", FORMATS.values(), ids=FORMATS.keys())
def test_each_format_is_described_by_name(settings, names, nearest):
    text, alternative = describe(settings)
    for name in names:
        assert name in text
    assert alternative.startswith(nearest)


# Formats a reader in quant/checkpoint/ takes; the others are refused.
READ = (
    "gptq-4bit",
    "gptq-8bit-v2",
    "awq-gemm",
    "compressed-tensors-w8a8",
    "compressed-tensors-w4a16",
    "compressed-tensors-naive",
    "compressed-tensors-mixed-groups",
    "compressed-tensors-fp8-dynamic",
    "fp8-block-wise",
)
REFUSED = {name: value for name, value in FORMATS.items() if name not in READ}


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
@pytest.mark.parametrize("name", READ)
def test_formats_with_a_reader_are_read(key, name, tmp_path):
    settings = FORMATS[name][0]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], key: settings}))
    read = check_checkpoint_quantization(tmp_path)
    assert read is not None and read.format == name.split("-")[0].replace(
        "compressed", "compressed-tensors"
    )


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
@pytest.mark.parametrize("settings, names, nearest", REFUSED.values(), ids=REFUSED.keys())
def test_each_format_without_a_reader_is_refused(key, settings, names, nearest, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], key: settings}))
    with pytest.raises(ValueError) as refusal:
        check_checkpoint_quantization(tmp_path)
    message = str(refusal.value)
    assert f"quantized checkpoint ({key}: " in message
    assert all(name in message for name in names)
    assert f"load the unquantized checkpoint with {nearest}" in message.lower()


def build_w8a8_checkpoint(model_dir, *, with_config: bool = True):
    """A random Llama as llm-compressor's W8A8 scheme saves it: each decoder projection's
    weight in int8 with its per-channel weight_scale ([out, 1]), the lm_head kept in
    float, and the scheme in config.json."""
    hf = build_hf_model("llama", model_dir)
    save_char_tokenizer(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [
        n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")
    ]:
        weight = tensors[name]
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        tensors[name] = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
        tensors[name.replace(".weight", ".weight_scale")] = scale
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    if with_config:
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = W8A8
        (model_dir / "config.json").write_text(json.dumps(config))
    return hf


@pytest.fixture
def no_weight_read(monkeypatch):
    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights, "iter_tensors", read)


def test_a_w8a8_checkpoint_runs_its_int8_weights_with_their_scales(tmp_path):
    """What loaded silently wrong before the format had a reader: its int8 weights read
    as plain numbers, without their scales. Now they run on the int8 kernels, scaled."""
    hf = build_w8a8_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    layer = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    assert isinstance(layer, Int8Linear)
    want = hf.model.layers[0].self_attn.o_proj.weight.abs().amax(dim=1) / 127
    torch.testing.assert_close(layer.scale, want.float(), rtol=1e-6, atol=0)


def test_own_quantization_on_a_quantized_checkpoint_is_refused(tmp_path, no_weight_read):
    build_w8a8_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="quantized already .*leave quantization unset"):
        LLM(str(tmp_path), dtype="float32", quantization="int8")


def test_its_int8_weights_without_the_config_are_refused_by_tensor(tmp_path, no_weight_read):
    """The same weights with the quantization_config lost: never read as plain numbers."""
    build_w8a8_checkpoint(tmp_path, with_config=False)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight \(int8\)"):
        LLM(str(tmp_path), dtype="float32")


def test_an_encoder_checkpoint_is_refused_too(tmp_path):
    from pooling_models import build_encoder

    build_encoder("bert", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = W8A8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not read for encoder models"):
        LLM(str(tmp_path), dtype="float32")


def test_a_jobs_plan_and_dry_run_refuse_a_format_not_read_before_loading(tmp_path, no_weight_read):
    """Planning describes the model without loading it: the refusal comes there, so a
    `--dry-run` never prices a job the engine would refuse; a format that is read is
    described with its quantization."""
    from tokenmill.engine import describe_model
    from tokenmill.pipelines.job import run_job

    model_dir = tmp_path / "w8a8"
    build_w8a8_checkpoint(model_dir)
    described = describe_model(str(model_dir))
    assert described.quantization == "compressed-tensors int-quantized, W8A8 per-channel"
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = REFUSED["bitsandbytes-int8"][0]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method bitsandbytes, int8"):
        describe_model(str(model_dir))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "prompt": "hi"}\n')
    with pytest.raises(ValueError, match="quant_method bitsandbytes, int8"):
        run_job(str(rows), str(tmp_path / "out"), model=str(model_dir), dry_run=True)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
