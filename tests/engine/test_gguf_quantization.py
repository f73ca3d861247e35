"""quantization="gguf": the GGUF's blocks decode bit-exactly as the gguf package decodes
them, and the engine running them computes the float model of exactly those weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_models import make_engine, run_all
from model_fixtures import write_tiny_gguf

from tokenmill.engine.kernels.q4_linear import native_q4_isa
from tokenmill.engine.loader import gguf_blocks
from tokenmill.engine.loader.gguf_blocks import BLOCK_FORMATS, decode
from tokenmill.engine.loader.gguf_convert import convert_gguf, hf_tensor_name
from tokenmill.engine.quant import quantized_targets
from tokenmill.engine.quant.gguf_linear import (
    GroupedLinear,
    Q4Linear,
    RowConcat,
    check_gguf_blocks,
    gguf_module,
)
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.int8 import Int8Linear
from tokenmill.engine.types.sampling_params import SamplingParams

# Byte offsets of each format's f16 scale fields: random bytes there could be NaN or huge.
_F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks [rows, bytes per row] with small finite f16 scales."""
    _, nbytes = BLOCK_FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[kind]:
        scales = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(BLOCK_FORMATS))
def test_blocks_decode_bit_exactly_as_gguf_dequantizes(kind):
    raw = random_blocks(kind, rows=6, blocks_per_row=3)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, -1)
    got = decode(torch.from_numpy(raw), kind).dequantize().numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_fused_parts_in_different_formats_run_side_by_side():
    """q in Q4_K, k in Q6_K, v in Q8_0: one module per part (Q4_K on the int4 kernel),
    outputs concatenated, each the product with exactly its decoded weights."""
    kinds = ["Q4_K", "Q6_K", "Q8_0"]
    raws = [random_blocks("Q4_K", 16, 2, 1), random_blocks("Q6_K", 8, 2, 2)]
    raws.append(random_blocks("Q8_0", 8, 16, 3))
    weights = [decode(torch.from_numpy(r), k) for r, k in zip(raws, kinds)]
    bias = torch.randn(32)
    module = gguf_module(weights, kinds, bias)
    assert isinstance(module, RowConcat)
    assert [type(p).__name__ for p in module.parts] == ["Int4Linear", "_WithBias", "_WithBias"]
    x = torch.randn(5, 512)
    full = torch.cat([w.dequantize() for w in weights])
    want = x.double() @ full.double().t() + bias.double()
    got = module(x).double()
    # The Q4_K rows go through the int4 kernel in bf16; the others are exact in fp32.
    relative = (got[:, :16] - want[:, :16]).norm() / want[:, :16].norm()
    assert float(relative) < 1e-2
    # fp32 sums of 512 products of random blocks' large values: rounding ~1e-5 relative.
    relative = (got[:, 16:] - want[:, 16:]).norm() / want[:, 16:].norm()
    assert float(relative) < 1e-5


@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_grouped_layers_in_bf16_compute_the_bf16_model_of_their_blocks(kind, rows):
    """A bf16 engine's grouped layer is the bf16 linear of exactly its decoded weights,
    rounded once to bf16 - the weights the float mode would hold - to the bit."""
    blocks_per_row = 512 // (32 if kind in ("Q5_0", "Q8_0") else 256)
    weight = decode(torch.from_numpy(random_blocks(kind, 48, blocks_per_row, 4)), kind)
    layer = GroupedLinear(weight)
    x = torch.randn(rows, 512).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    want = torch.nn.functional.linear(x, weight.dequantize().bfloat16())
    assert torch.equal(got, want)
    # And near the exact product (bf16 weights and activations, fp32 sums).
    exact = x.double() @ weight.dequantize().double().t()
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("kinds", [["Q4_0"], ["Q4_1"], ["Q4_0", "Q4_1", "Q4_0"]])
def test_4bit_blocks_run_on_the_native_product_where_it_is_built(kinds, cpu_path):
    """Q4_0 and Q4_1 layers (a fused projection's parts too) take the native 4-bit product
    where the library has it: the float model of their blocks to within the activations'
    8-bit block quantization; its bf16 expansion, for large calls on AMX, gives the bf16
    linear of exactly the decoded weights. Elsewhere they stay on PyTorch's int4 kernel."""
    isa = native_q4_isa()
    cpu_path("gguf 4-bit layers", f"native 4-bit product ({isa})" if isa else "int4 kernel")
    weights = [decode(torch.from_numpy(random_blocks(k, 16, 4, i)), k) for i, k in enumerate(kinds)]
    bias = torch.randn(16 * len(kinds))
    module = gguf_module(weights, kinds, bias)
    if isa is None:
        assert isinstance(module, Int4Linear)
        return
    assert isinstance(module, Q4Linear) and module.packed.affine == ("Q4_1" in kinds)
    full = torch.cat([w.dequantize() for w in weights])
    x = torch.randn(7, 128)
    want = x.double() @ full.double().t() + bias.double()
    got = module(x)
    assert got.dtype == torch.float32
    assert float((got.double() - want).norm() / want.norm()) < 1e-2
    module.expand_min_rows = 1  # what AMX CPUs do for calls of EXPAND_MIN_ROWS or more
    x16 = x.bfloat16()
    expected = torch.nn.functional.linear(x16, full.bfloat16(), bias.bfloat16())
    assert torch.equal(module(x16), expected)


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_engine_computes_the_float_model_of_the_gguf_weights(quant_type, tmp_path, monkeypatch):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type=quant_type, hidden_size=64)
    model_dir = convert_gguf(tiny.path, tmp_path / "model", dtype=torch.float32)
    types = gguf_blocks.read_types(model_dir)
    assert set(types.values()) == {quant_type}
    prompts = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    engine = make_engine(model_dir, quantization="gguf")
    outputs = run_all(engine, prompts, params)

    # The reference: the float engine with every decoder weight set to the GGUF's values.
    monkeypatch.setenv("TOKENMILL_PACKED_LINEAR", "0")
    reference_engine = make_engine(model_dir)
    raw = gguf_blocks.load_raw(model_dir, list(types))
    decoded = {name: decode(raw[name], kind).dequantize() for name, kind in types.items()}
    with torch.no_grad():
        for index, layer in enumerate(reference_engine.runner.model.model.layers):
            p = f"model.layers.{index}"
            layer.self_attn.qkv_proj.weight.copy_(
                torch.cat([decoded[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
            )
            layer.self_attn.o_proj.weight.copy_(decoded[f"{p}.self_attn.o_proj.weight"])
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([decoded[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up")])
            )
            layer.mlp.down_proj.weight.copy_(decoded[f"{p}.mlp.down_proj.weight"])
    assert len(quantized_targets(reference_engine.runner.model)) == 4 * len(
        reference_engine.runner.model.model.layers
    )
    reference = run_all(reference_engine, prompts, params)
    # 8- and 5-bit blocks compute in fp32, exactly the GGUF's weights; 4-bit ones take
    # activations quantized to 8 bits per block of 32 (the native product) or run
    # PyTorch's int4 kernel in bf16 (activations and scales rounded).
    tolerance = 1e-2 if quant_type in ("Q4_0", "Q4_1") else 1e-4
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            for token, value in theirs.items():
                assert abs(ours[token] - value) < tolerance


def test_quantize_lm_head_runs_the_output_layer_in_int8(tmp_path):
    """The GGUF's decoder blocks as they are, and the lm_head as the int8 mode's: smoothed
    from a calibration pass over the gguf model itself, close to the float lm_head."""
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type="Q4_0", hidden_size=64)
    model_dir = convert_gguf(tiny.path, tmp_path / "model", dtype=torch.float32)
    prompts = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    float_head = make_engine(model_dir, quantization="gguf")
    int8_head = make_engine(model_dir, quantization="gguf", quantize_lm_head=True)
    head = int8_head.runner.model.lm_head
    assert isinstance(head, Int8Linear) and not isinstance(
        float_head.runner.model.lm_head, Int8Linear
    )
    assert head.inv_smooth is not None and bool((head.inv_smooth != 1).any())
    layers = int8_head.runner.model.model.layers
    assert isinstance(
        layers[0].mlp.down_proj, type(float_head.runner.model.model.layers[0].mlp.down_proj)
    )
    diffs = []
    outputs = run_all(int8_head, prompts, params)
    for prompt, out, ref in zip(prompts, outputs, run_all(float_head, prompts, params)):
        for token, ours, theirs in zip(
            prompt[1:], out.prompt_logprobs[1:], ref.prompt_logprobs[1:]
        ):
            diffs.append(abs(ours[token] - theirs[token]))
    print(f"\ngguf int8 lm_head: prompt logprob |diff| max {max(diffs):.4f}")
    assert max(diffs) < 0.03, max(diffs)  # measured: 0.005


def test_models_without_blocks_or_with_other_formats_are_refused(tmp_path):
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", quant_type="F16", hidden_size=64)
    with pytest.raises(ValueError, match="needs a model converted from a GGUF file"):
        make_engine(convert_gguf(f16.path, tmp_path / "f16"), quantization="gguf")
    # gguf-py cannot quantize Q5_K: write raw blocks (176 bytes per 256 weights).
    raw = np.random.default_rng(0).integers(0, 256, (8, 176), np.uint8)
    writer = gguf.GGUFWriter(tmp_path / "q5k.gguf", "llama")
    qtype = gguf.GGMLQuantizationType.Q5_K
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "q5k"
    out.mkdir()
    reader = gguf.GGUFReader(tmp_path / "q5k.gguf")
    kept = gguf_blocks.write_blocks(reader, {}, out, hf_tensor_name, lambda rows, name: rows)
    assert kept == {"model.layers.0.self_attn.v_proj.weight": "Q5_K"}
    with pytest.raises(ValueError, match="this GGUF has Q5_K"):
        check_gguf_blocks(out)
