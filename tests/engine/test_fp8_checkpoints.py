"""FP8 (e4m3) checkpoints: compressed-tensors' float-quantized weights (per channel, per
tensor, in blocks; FP8_DYNAMIC's per-token FP8 activations) built with
compressed-tensors' own compressors, and block-wise `quant_method: fp8` checkpoints (Qwen's
and DeepSeek's -FP8 layout) built by a packer written from that layout, cross-checked with
transformers' own FP8 dequantization. The weights run on the native fp8 kernel,
dequantized inside it: an fp32 engine computes the dense fp32 model holding the
dequantized weights (greedy tokens equal, prompt log-probs within 1e-3)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from click.testing import CliRunner
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from hf_models import build_hf_model, make_engine, run_all, save_char_tokenizer
from quantized_checkpoints import fp8_block_config, write_fp8_blocks
from reference_quantizers import write_llmcompressor_checkpoint
from safetensors.torch import load_file, save_file
from test_llmcompressor_checkpoints import engine_logprobs, reference_logprobs, reference_model

from tokenmill.cli import main
from tokenmill.engine.kernels import fp8_linear as kernel
from tokenmill.engine.quant.checkpoint import read_checkpoint_quantization
from tokenmill.engine.quant.checkpoint.compressed_tensors import CompressedTensors
from tokenmill.engine.quant.checkpoint.fp8 import Fp8Linear, round_fp8_per_token
from tokenmill.engine.quant.checkpoint.fp8_block import Fp8Block
from tokenmill.engine.quant.gguf_linear import RowConcat
from tokenmill.engine.types.sampling_params import SamplingParams

PROMPTS = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3], [40, 41, 42] * 5]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=3)
ALL_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def _worst(ours, theirs) -> float:
    return max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))


# ---- the kernel ------------------------------------------------------------------------


def test_the_kernel_decodes_every_e4m3_code_as_torch_does():
    """Identity inputs read back each weight: all 254 non-NaN codes (subnormals, both
    zeros, 448) times a scale of 1 are torch's float8_e4m3fn values, exactly."""
    codes = ALL_CODES.reshape(2, 127)
    y = kernel.fp8_linear(torch.eye(127), codes, torch.ones(1, 1), (2, 127), None)
    assert torch.equal(y.t(), codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_the_fp32_product_of_the_dequantized_weight_with_ragged_blocks(dtype):
    """70 x 300 with 32 x 128 blocks (the last ones shorter in both directions), a bias:
    against fp64 on the same dequantized weights - fp32 sums' rounding, or bf16's one
    rounding of the result."""
    g = torch.Generator().manual_seed(3)
    codes = ALL_CODES[torch.randint(0, len(ALL_CODES), (70, 300), generator=g)]
    scales = torch.rand(3, 3, generator=g) + 0.01
    x = torch.randn(5, 300, generator=g).to(dtype)
    bias = torch.randn(70, generator=g)
    y = kernel.fp8_linear(x, codes, scales, (32, 128), bias)
    weight = kernel.dequantize_rows(codes, scales, (32, 128), 0, 70)
    rows, cols = torch.arange(70) // 32, torch.arange(300) // 128
    exact = codes.view(torch.float8_e4m3fn).double() * scales.double()[rows][:, cols]
    assert torch.equal(weight.double(), exact.float().double())  # one rounding per weight
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-3)
    else:
        assert torch.equal(y, want.float().to(torch.bfloat16)) or torch.allclose(
            y.double(), want, rtol=2**-8, atol=0
        )


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic", "avx512_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_calls_on_the_fp32_loops_run_on_pytorchs_tiles(monkeypatch, isa, dtype):
    """From TILES_MIN_ROWS rows a call the kernel would run on its fp32 loops runs on
    PyTorch's tiles - by the CPU's kernel path and the input's dtype - and computes the
    same product: the fp64 product of the dequantized weight, to fp32 sums' rounding."""
    if kernel.native_isa() is None:
        pytest.skip("no native library: every call runs on PyTorch's tiles")
    monkeypatch.setattr(kernel, "native_isa", lambda: isa)
    g = torch.Generator().manual_seed(5)
    codes = ALL_CODES[torch.randint(0, len(ALL_CODES), (70, 300), generator=g)]
    scales = torch.rand(3, 3, generator=g) + 0.01
    bias = torch.randn(70, generator=g)
    weight = kernel.dequantize_rows(codes, scales, (32, 128), 0, 70).double()
    bf16_dots = dtype == torch.bfloat16 and isa == "avx512_bf16"
    tiles = []
    real = kernel.dequantize_rows
    monkeypatch.setattr(kernel, "dequantize_rows", lambda *a: tiles.append(a) or real(*a))
    for rows in (kernel.TILES_MIN_ROWS - 1, kernel.TILES_MIN_ROWS, 2 * kernel.TILES_MIN_ROWS):
        on_tiles = rows >= kernel.TILES_MIN_ROWS and not bf16_dots
        assert kernel.runs_on_tiles(rows, dtype) == on_tiles
        x = torch.randn(rows, 300, generator=g).to(dtype)
        tiles.clear()
        y = kernel.fp8_linear(x, codes, scales, (32, 128), bias, max_isa=None)
        assert bool(tiles) == on_tiles
        want = torch.nn.functional.linear(x.double(), weight, bias.double())
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-3)
        else:  # one rounding of the fp32 result to bf16: half an ulp, or a whole one where
            # the two fp32 sums straddle a rounding boundary
            torch.testing.assert_close(y.double(), want, rtol=2**-8, atol=1e-2)
        tiles.clear()
        pinned = kernel.fp8_linear(x, codes, scales, (32, 128), bias, max_isa="generic")
        assert not tiles  # a pinned path is the kernel's, whatever the rows
        torch.testing.assert_close(y.double(), pinned.double(), rtol=2**-7, atol=1e-2)


def test_without_the_native_library_pytorch_computes_the_same_product(monkeypatch):
    g = torch.Generator().manual_seed(4)
    codes = ALL_CODES[torch.randint(0, len(ALL_CODES), (40, 96), generator=g)]
    scales = torch.rand(1, 1, generator=g) + 0.5  # one scale: per tensor
    x = torch.randn(3, 96, generator=g)
    native = kernel.fp8_linear(x, codes, scales, (40, 96), None)
    monkeypatch.setattr(kernel, "_library", lambda: None)
    torch.testing.assert_close(kernel.fp8_linear(x, codes, scales, (40, 96), None), native)


# ---- compressed-tensors float-quantized --------------------------------------------------

FP8_SCHEMES = {
    "channel": {"strategy": "channel"},
    "tensor": {"strategy": "tensor"},
    "block-64x64": {"strategy": "block", "block_structure": [64, 64]},
}


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """compressed-tensors' FP8 weight-only checkpoints of llm-compressor's random Llama
    (reference_quantizers), one per weight strategy: name -> model directory."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, args in FP8_SCHEMES.items():
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, **args)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
        out[name] = write_llmcompressor_checkpoint(root / name, name, scheme)
    return out


def _greedy(model_dir, num_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    prompts = [[3, 5, 7, 9, 11, 4, 6, 30, 31], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3, 60, 2]]
    return [out.token_ids for out in run_all(make_engine(model_dir), prompts, params)], prompts


@pytest.mark.parametrize("name", FP8_SCHEMES)
def test_fp8_weights_are_transformers_on_compressed_tensors_decompression(name, fp8_checkpoints):
    model_dir = fp8_checkpoints[name]
    engine, ours = engine_logprobs(model_dir)
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    assert layer.mlp.down_proj.codes.dtype == torch.uint8  # one byte a weight, in memory
    reference = reference_model(model_dir)
    worst = _worst(ours, reference_logprobs(reference))
    assert worst < 1e-3, worst
    tokens, prompts = _greedy(model_dir)
    for got, prompt in zip(tokens, prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in got:
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(prompt) :]


def test_fp8_dynamic_rounds_activations_as_compressed_tensors_does(llmcompressor_checkpoints):
    """FP8_DYNAMIC: each token's activations rounded to e4m3 with max|x| / 448 before the
    product, as compressed-tensors' forward does: ours equals transformers with that
    rounding to float noise, far inside the rounding's own effect on the log-probs."""
    model_dir = llmcompressor_checkpoints["FP8_DYNAMIC"]
    engine, ours = engine_logprobs(model_dir)
    assert engine.runner.model.model.layers[0].mlp.down_proj.activations == "fp8-token"
    with_rounding = reference_logprobs(reference_model(model_dir, activations=True))
    without = reference_logprobs(reference_model(model_dir))
    ours_vs_ct, scheme_error = _worst(ours, with_rounding), _worst(without, with_rounding)
    print(
        f"\nFP8_DYNAMIC prompt logprobs: ours vs compressed-tensors {ours_vs_ct:.2e}, "
        f"the activation rounding itself {scheme_error:.4f}"
    )
    assert ours_vs_ct < 1e-4 and scheme_error > 0.05


def test_fp8_token_rounding_is_compressed_tensors_own():
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    x = torch.randn(1, 6, 96, generator=torch.Generator().manual_seed(5)) * 3
    x[0, 2] = 0  # a zero row keeps its zeros
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(1, 1))
    assert torch.equal(round_fp8_per_token(x), fake_quantize(x, scale, zero, args))


def test_fp8_models_info_names_the_format_and_kernel(tmp_path, llmcompressor_checkpoints):
    model_dir = tmp_path / "FP8_DYNAMIC"
    shutil.copytree(llmcompressor_checkpoints["FP8_DYNAMIC"], model_dir)
    save_char_tokenizer(model_dir)
    result = CliRunner().invoke(main, ["models", "info", str(model_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    fields = {k: v.strip() for k, v in (ln.split(":", 1) for ln in result.output.splitlines())}
    assert fields["quantization"] == "compressed-tensors float-quantized, FP8 W8A8 per-channel"
    assert fields["weight bits"] == "8"
    assert fields["kernels"].startswith("FP8 W8A8 per-channel: ")
    assert kernel.kernel_name() in fields["kernels"]
    assert "activations rounded to fp8 per token" in fields["kernels"]
    assert "not loadable" not in fields


# ---- block-wise quant_method fp8 ---------------------------------------------------------


def _block_pair(tmp_path, block, excluded=(), **model):
    build_hf_model("llama", tmp_path / "float", **model)
    save_char_tokenizer(tmp_path / "float")
    layers = write_fp8_blocks(
        tmp_path / "float", tmp_path / "q", tmp_path / "dense", block, excluded
    )
    return tmp_path / "q", tmp_path / "dense", layers


def _assert_same_model(model_dir, dense_dir, tolerance=1e-3) -> float:
    outputs = run_all(make_engine(model_dir), PROMPTS, PARAMS)
    reference = run_all(make_engine(dense_dir), PROMPTS, PARAMS)
    worst = 0.0
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            worst = max(worst, *(abs(ours[t] - v) for t, v in theirs.items()))
    assert worst < tolerance, worst
    return worst


def test_block_fp8_packer_is_what_transformers_dequantizes(tmp_path):
    """transformers loads a block-wise FP8 checkpoint on a CPU by dequantizing it (its
    FineGrainedFP8 path, blocks that divide the weights): every weight it ends with equals
    our packer's dequantization, and our engine computes that model."""
    model_dir, dense_dir, layers = _block_pair(tmp_path, (32, 64))
    assert len(layers) == 14
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dense = load_file(dense_dir / "model.safetensors")
    state = hf.state_dict()
    for name in layers:
        assert torch.equal(state[f"{name}.weight"], dense[f"{name}.weight"]), name
    _assert_same_model(model_dir, dense_dir)


def test_ragged_128_blocks_and_excluded_layers(tmp_path):
    """128 x 128 blocks (the Hub's) over a model whose k/v projections have 64 rows and
    whose MLP has 320: the last blocks shorter, as DeepSeek's layout allows and
    transformers refuses; layer 1's o_proj kept float by modules_to_not_convert."""
    excluded = ("model.layers.1.self_attn.o_proj",)
    model_dir, dense_dir, layers = _block_pair(
        tmp_path, (128, 128), excluded, hidden_size=192, intermediate_size=320
    )
    assert len(layers) == 13
    engine = make_engine(model_dir)
    blocks = engine.runner.model.model.layers
    assert not isinstance(blocks[1].self_attn.o_proj, Fp8Linear)  # float, as dense runs it
    assert isinstance(blocks[0].self_attn.o_proj, Fp8Linear)
    qkv = blocks[0].self_attn.qkv_proj
    assert isinstance(qkv, RowConcat) and all(isinstance(p, Fp8Linear) for p in qkv.parts)
    _assert_same_model(model_dir, dense_dir)


def test_block_fp8_memory_is_the_codes_and_scales(tmp_path):
    model_dir, _, layers = _block_pair(tmp_path, (64, 64))
    engine = make_engine(model_dir)
    gate_up = engine.runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, Fp8Linear)
    n, k = gate_up.out_features, gate_up.in_features
    assert gate_up.weight_bytes == n * k + 4 * (n // 64) * (k // 64)


def test_a_nan_code_is_refused_naming_the_layer(tmp_path):
    model_dir, _, _ = _block_pair(tmp_path, (64, 64))
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    codes = tensors[name].view(torch.uint8).clone()
    codes[3, 5] = 0x7F
    tensors[name] = codes.view(torch.float8_e4m3fn)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.up_proj: weight holds NaN"):
        make_engine(model_dir)


def test_a_missing_or_misshapen_block_scale_is_refused_by_name(tmp_path):
    model_dir, _, _ = _block_pair(tmp_path, (64, 64))
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1].contiguous()  # one row of blocks short
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \(1, 1\), expected \(2, 1\)"):
        make_engine(model_dir)
    del tensors[name]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"missing {name} \(the block scales\)"):
        make_engine(model_dir)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_scheme": "static"}, "activation_scheme static .* is not read"),
        ({"fmt": "e5m2"}, "fmt e5m2 is not read"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt ue8m0 .* is not read"),
        ({"weight_block_size": None}, "without weight_block_size"),
        ({"kv_cache_scheme": {"type": "float"}}, "FP8 KV-cache scales are not read"),
    ],
)
def test_block_fp8_variants_not_run_are_refused_by_name(change, message):
    settings = {**fp8_block_config((128, 128)), **change}
    with pytest.raises(ValueError, match=message):
        Fp8Block().parse(settings)


def test_block_fp8_info_and_ledger_name(tmp_path):
    model_dir, _, _ = _block_pair(tmp_path, (64, 64))
    read = read_checkpoint_quantization(
        json.loads((model_dir / "config.json").read_text())["quantization_config"]
    )
    assert read.summary == "fp8 block-wise, FP8 W8A16 block 64x64"
    assert read.bits == (8,)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"strategy": "group", "group_size": 32}, "FP8 weight strategy 'group' is not read"),
        ({"num_bits": 4}, "float-quantized with 4-bit float weights is not read"),
        ({"type": "int"}, "float-quantized with 8-bit int weights is not read"),
    ],
)
def test_fp8_weight_variants_not_run_are_refused_by_name(
    change, message, llmcompressor_checkpoints
):
    raw = json.loads((llmcompressor_checkpoints["FP8_DYNAMIC"] / "config.json").read_text())
    settings = raw["quantization_config"]
    settings["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(ValueError, match=message):
        CompressedTensors().parse(settings)


def test_static_fp8_activations_and_kv_scales_are_refused_by_name(llmcompressor_checkpoints):
    raw = json.loads((llmcompressor_checkpoints["FP8_DYNAMIC"] / "config.json").read_text())
    settings = raw["quantization_config"]
    acts = settings["config_groups"]["group_0"]["input_activations"]
    static = json.loads(json.dumps(settings))
    static["config_groups"]["group_0"]["input_activations"] = {
        **acts,
        "dynamic": False,
        "strategy": "tensor",
    }
    with pytest.raises(ValueError, match="dynamic per-token FP8 \\(FP8_DYNAMIC\\) is"):
        CompressedTensors().parse(static)
    settings["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    with pytest.raises(ValueError, match="kv_cache_scheme: FP8/int8 KV-cache scales"):
        CompressedTensors().parse(settings)
