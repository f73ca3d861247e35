"""compressed-tensors checkpoints (llm-compressor's W4A16, W8A16, W8A8): decoded exactly as
compressed-tensors' own decompressors decode them, run on the int4/int8 kernels, and an
fp32 engine over them computes the dense fp32 model of exactly their dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.naive_quantized import IntQuantizationCompressor
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from hf_models import build_hf_model, make_engine, run_all, save_char_tokenizer
from quantized_checkpoints import (
    compressed_tensors_layer,
    ct_config,
    quantize_int,
    write_compressed_tensors,
)
from safetensors.torch import load_file, save_file

from tokenmill.engine.quant.checkpoint.compressed_tensors import CompressedTensors
from tokenmill.engine.quant.checkpoint.layers import ExactIntLinear, PermutedInput, build_layer
from tokenmill.engine.quant.gguf_linear import RowConcat
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.int8 import Int8Linear
from tokenmill.engine.quant.packed_linear import PackedLinear
from tokenmill.engine.types.sampling_params import SamplingParams

PROMPTS = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3], [40, 41, 42] * 5]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=3)
FLOAT_LAYERS = (torch.nn.Linear, PackedLinear)
_COMPRESSORS = {
    "pack-quantized": PackedQuantizationCompressor,
    "int-quantized": IntQuantizationCompressor,
}


def scheme_args(bits, group_size, symmetric):
    strategy = "group" if group_size else "channel"
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
        ),
    )


def reader_for(fmt, bits, group_size, symmetric):
    return CompressedTensors().parse(ct_config(fmt, bits, group_size, symmetric))


VARIANTS = {
    "w4-g32-sym": ("pack-quantized", 4, 32, True),
    "w4-g32-asym": ("pack-quantized", 4, 32, False),
    "w4-channel-asym": ("pack-quantized", 4, None, False),
    "w8-g64-packed": ("pack-quantized", 8, 64, True),
    "w8-channel-int": ("int-quantized", 8, None, True),
    "w8-channel-int-asym": ("int-quantized", 8, None, False),
}


@pytest.mark.parametrize("fmt, bits, group_size, symmetric", VARIANTS.values(), ids=VARIANTS)
def test_our_packing_is_compressed_tensors_own_and_decodes_as_it_does(
    fmt, bits, group_size, symmetric
):
    """The tests' packer writes the bytes compressed-tensors' compressor writes for the same
    codes and scales, and the reader decodes them to exactly its decompressor's values."""
    n, k = 48, 96 + 40  # 136 inputs: not a multiple of 32 codes per word or of 64
    if group_size and k % group_size:
        k = 128
    weight = torch.randn(n, k)
    quantized = quantize_int(weight, bits, group_size, symmetric)
    ours = compressed_tensors_layer(quantized, fmt)
    scheme = scheme_args(bits, group_size, symmetric)
    state = {"weight": quantized.dequantize(), "weight_scale": quantized.scale}
    if not symmetric:
        state["weight_zero_point"] = quantized.zero.to(torch.int8)
    theirs = _COMPRESSORS[fmt].compress(state, scheme)
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name].reshape(ours[name].shape)), name
    expected = _COMPRESSORS[fmt].decompress(theirs, scheme)["weight"]
    reader = reader_for(fmt, bits, group_size, symmetric)
    layer_scheme = reader.scheme("model.layers.0.mlp.up_proj")
    decoded = reader.decode(layer_scheme, theirs, n, k)
    assert torch.equal(decoded.dequantize(), expected)


def test_a_ragged_last_group_takes_its_own_scale():
    """group 128 over 192 inputs: the second group is 64 wide, with its own scale."""
    weight = torch.randn(32, 192)
    quantized = quantize_int(weight, 4, 128, True)
    assert quantized.scale.shape == (32, 2)
    tensors = compressed_tensors_layer(quantized, "pack-quantized")
    reader = reader_for("pack-quantized", 4, 128, True)
    decoded = reader.decode(reader.scheme("x.q_proj"), tensors, 32, 192)
    values = decoded.dequantize()
    assert torch.equal(values[:, 128:], quantized.q[:, 128:].float() * quantized.scale[:, 1:])
    assert torch.equal(values, quantized.dequantize())


def model_pair(tmp_path, config, kind="llama", scale_dtype=torch.float32, **model):
    build_hf_model(kind, tmp_path / "float", **model)
    save_char_tokenizer(tmp_path / "float")
    layers = write_compressed_tensors(
        tmp_path / "float", tmp_path / "q", tmp_path / "dense", config, scale_dtype=scale_dtype
    )
    return tmp_path / "q", tmp_path / "dense", layers


def assert_same_model(model_dir, dense_dir, tolerance=1e-3):
    """Greedy tokens equal and prompt log-probs within `tolerance` of the dense model's."""
    outputs = run_all(make_engine(model_dir), PROMPTS, PARAMS)
    reference = run_all(make_engine(dense_dir), PROMPTS, PARAMS)
    worst = 0.0
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            for token, value in theirs.items():
                worst = max(worst, abs(ours[token] - value))
    assert worst < tolerance, worst
    return worst


ENGINE_VARIANTS = {
    "w4a16-g32": (ct_config("pack-quantized", 4, 32), {}),
    "w4a16-g32-asym-bf16-scales": (ct_config("pack-quantized", 4, 32, False), {}),
    "w4a16-ragged-g128": (
        ct_config("pack-quantized", 4, 128),
        dict(hidden_size=192, intermediate_size=320, num_attention_heads=4),
    ),
    "w4a16-channel": (ct_config("pack-quantized", 4, None), {}),
    "w8a16-naive": (ct_config("naive-quantized", 8, None), {}),
    "w8a16-packed-g64-asym": (ct_config("pack-quantized", 8, 64, False), {}),
}


@pytest.mark.parametrize("config, model", ENGINE_VARIANTS.values(), ids=ENGINE_VARIANTS)
def test_fp32_engine_computes_the_dense_model_of_the_dequantized_weights(config, model, tmp_path):
    scale_dtype = torch.bfloat16 if "asym" in json.dumps(config) else torch.float32
    model_dir, dense_dir, layers = model_pair(tmp_path, config, scale_dtype=scale_dtype, **model)
    assert len(layers) == 14  # 7 projections x 2 layers; lm_head ignored
    engine = make_engine(model_dir)
    modules = list(engine.runner.model.model.layers[0].modules())
    assert sum(isinstance(m, ExactIntLinear) for m in modules) == 4
    assert not isinstance(engine.runner.model.lm_head, ExactIntLinear)
    assert_same_model(model_dir, dense_dir)


def test_a_mixed_config_runs_each_layer_in_its_own_groups_scheme(tmp_path):
    """llm-compressor's mixed-precision configs: k and v in W8A16 per channel (a pattern
    outranks Linear), every other layer W4A16 g32 - so the fused qkv layer mixes them."""
    config = ct_config("pack-quantized", 4, 32, False)
    eight = ct_config("int-quantized", 8, None, targets=(r"re:.*self_attn\.(k|v)_proj$",))
    config["config_groups"]["group_1"] = eight["config_groups"]["group_0"]
    config["format"] = "mixed-precision"
    model_dir, dense_dir, layers = model_pair(tmp_path, config)
    assert {w.bits for n, w in layers.items() if n.endswith(("k_proj", "v_proj"))} == {8}
    assert {w.bits for n, w in layers.items() if not n.endswith(("k_proj", "v_proj"))} == {4}
    engine = make_engine(model_dir)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, RowConcat) and len(qkv.parts) == 3
    assert all(isinstance(part, ExactIntLinear) for part in qkv.parts)
    assert [part.bits for part in qkv.parts] == [4, 8, 8]
    assert_same_model(model_dir, dense_dir)
    summary = CompressedTensors().parse(config).all_schemes()
    assert sorted(s.label for s in summary) == ["W4A16 g32, zero points", "W8A16 per-channel"]


def test_ignore_names_and_patterns_keep_those_layers_float_and_lm_head_can_be_quantized(tmp_path):
    config = ct_config(
        "pack-quantized", 4, 32, ignore=("re:.*self_attn\\.o_proj$", "model.layers.1.mlp.up_proj")
    )
    model_dir, dense_dir, layers = model_pair(tmp_path, config, tie_word_embeddings=False)
    assert "lm_head" in layers and "model.layers.0.self_attn.o_proj" not in layers
    assert "model.layers.1.mlp.up_proj" not in layers and "model.layers.0.mlp.up_proj" in layers
    engine = make_engine(model_dir)
    model = engine.runner.model
    assert isinstance(model.lm_head, ExactIntLinear)
    assert isinstance(model.model.layers[0].self_attn.o_proj, FLOAT_LAYERS)
    gate_up = model.model.layers[1].mlp.gate_up_proj  # gate quantized, up float
    assert isinstance(gate_up.parts[0], ExactIntLinear)
    assert isinstance(gate_up.parts[1], FLOAT_LAYERS)
    assert_same_model(model_dir, dense_dir)


def test_bias_and_tied_embeddings(tmp_path):
    """Qwen2's q/k/v biases load beside their quantized weights; its tied lm_head stays
    the embedding."""
    model_dir, dense_dir, _ = model_pair(tmp_path, ct_config("pack-quantized", 4, 32), "qwen2")
    engine = make_engine(model_dir)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ExactIntLinear) and qkv.bias is not None
    assert_same_model(model_dir, dense_dir)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
def test_4bit_layers_in_bf16_run_the_int4_kernel_on_the_checkpoint_values(group_size, symmetric):
    """In a bf16 engine 4-bit layers are Int4Linear: the int4 mode's kernel, on exactly the
    checkpoint's codes and scales (bf16 scales stay as they are) - the bf16 linear of the
    dequantized weights, to the kernel's bf16 rounding."""
    k = 192 if group_size == 128 else 256  # 128 over 192: ragged, blocks of 64
    weight = quantize_int(torch.randn(64, k), 4, group_size, symmetric)
    weight.scale = weight.scale.bfloat16()
    bias = torch.randn(64)
    layer = build_layer([weight], [_scheme(4, group_size, symmetric)], bias, dtype=torch.bfloat16)
    assert isinstance(layer, Int4Linear)
    x = torch.randn(5, k)
    want = x.double() @ weight.dequantize().double().t() + bias.double()
    got = layer(x.bfloat16()).double()
    assert float((got - want).norm() / want.norm()) < 1e-2
    fp32 = build_layer([weight], [_scheme(4, group_size, symmetric)], bias, dtype=torch.float32)
    assert isinstance(fp32, ExactIntLinear)
    exact = torch.nn.functional.linear(x, weight.dequantize(), bias)
    assert torch.equal(fp32(x), exact)


@pytest.mark.parametrize("rows", [(128, 64, 192), (128, 48)])
def test_a_fused_4bit_layer_built_part_by_part_is_the_layer_of_its_joined_parts(rows, monkeypatch):
    """gate_up and qkv are packed a part at a time into the layer's buffer (no joined
    int32 copy of the whole layer while loading): the same packed bytes, scales and
    products as packing the joined parts; parts of rows that are no whole int4pack block
    (48) take the joined route."""
    from tokenmill.engine.quant.checkpoint import layers

    k = 256
    parts = [
        quantize_int(torch.randn(n, k), 4, 64, symmetric=i % 2 == 0) for i, n in enumerate(rows)
    ]
    bias = torch.randn(sum(rows))
    schemes = [_scheme(4, 64, i % 2 == 0) for i in range(len(rows))]
    if len({s.symmetric for s in schemes}) > 1:  # one scheme for all parts, zero points or not
        schemes = [_scheme(4, 64, False)] * len(rows)
    concat = layers._concat
    joins = []
    monkeypatch.setattr(layers, "_concat", lambda p: joins.append(1) or concat(p))
    built = build_layer(parts, schemes, bias, dtype=torch.bfloat16)
    assert len(joins) == (1 if any(n % 64 for n in rows) else 0)  # the parts never joined
    joined = layers.as_int4_linear(concat(parts), bias)
    assert isinstance(built, Int4Linear) and isinstance(joined, Int4Linear)
    assert torch.equal(built.packed_weight, joined.packed_weight)
    assert torch.equal(built.scales_and_zeros, joined.scales_and_zeros)
    assert built.unpacks == joined.unpacks
    x = torch.randn(40, k).bfloat16()  # 40 rows: the expanded-weights path where it unpacks
    assert torch.equal(built(x), joined(x))
    assert torch.equal(built(x[:3]), joined(x[:3]))
    ones = torch.ones(sum(rows), k // 64)
    from_parts = Int4Linear.from_parts(
        [p.q for p in parts], ones, ones, None, group_size=64, offset=8
    )
    assert (from_parts is None) == any(n % 64 for n in rows)


def test_act_order_groups_run_on_the_int4_kernel_with_the_inputs_reordered():
    k = 128
    weight = quantize_int(torch.randn(32, k), 4, 32, True)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    weight.g_idx = torch.empty(k, dtype=torch.long)
    weight.g_idx[order] = torch.arange(k) // 32  # the inputs' groups, given one by one
    layer = build_layer([weight], [_scheme(4, 32, True)], None, dtype=torch.bfloat16)
    assert isinstance(layer, PermutedInput) and isinstance(layer.layer, Int4Linear)
    x = torch.randn(3, k)
    want = x.double() @ weight.dequantize().double().t()
    assert float((layer(x.bfloat16()).double() - want).norm() / want.norm()) < 1e-2


def _scheme(bits, group_size, symmetric, activations=None):
    from tokenmill.engine.quant.checkpoint.weights import LayerScheme

    return LayerScheme(
        "compressed-tensors pack-quantized", bits, group_size, symmetric, activations
    )


def test_w8a8_runs_the_int8_kernels_on_the_checkpoint_weights(tmp_path):
    config = ct_config("int-quantized", 8, None, activations=True)
    model_dir, dense_dir, layers = model_pair(tmp_path, config)
    engine = make_engine(model_dir)
    layer0 = engine.runner.model.model.layers[0]
    int8 = [m for m in layer0.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 and all(m.inv_smooth is None for m in int8)
    q = layers["model.layers.0.self_attn.o_proj"]
    assert torch.equal(layer0.self_attn.o_proj.scale, q.scale[:, 0].float())


def _edit(model_dir, change):
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


LAYER = "model.layers.1.mlp.down_proj"
BAD_TENSORS = {
    "missing-scale": (
        lambda t: t.pop(f"{LAYER}.weight_scale"),
        rf"missing {LAYER}\.weight_scale \(the scales\)",
    ),
    "scale-shape": (
        lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"][:, :2]}),
        rf"{LAYER}\.weight_scale has shape \(64, 2\), expected \(64, 4\)",
    ),
    "codes-dtype": (
        lambda t: t.update({f"{LAYER}.weight_packed": t[f"{LAYER}.weight_packed"].to(torch.int64)}),
        rf"{LAYER}\.weight_packed is int64, expected int32",
    ),
    "codes-shape": (
        lambda t: t.update({f"{LAYER}.weight_packed": t[f"{LAYER}.weight_packed"][:32]}),
        rf"{LAYER}\.weight_packed has shape \(32, 16\), expected \(64, 16\)",
    ),
    "missing-zero-points": (
        lambda t: t.pop(f"{LAYER}.weight_zero_point"),
        rf"missing {LAYER}\.weight_zero_point \(the zero points\)",
    ),
    "stray-float-weight": (
        lambda t: t.update({f"{LAYER}.weight": torch.zeros(64, 128)}),
        rf"no place for: {LAYER}\.weight",
    ),
}


@pytest.fixture
def no_weight_read(monkeypatch):
    from tokenmill.engine.loader import weights

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights, "iter_tensors", read)


@pytest.mark.parametrize("change, message", BAD_TENSORS.values(), ids=BAD_TENSORS)
def test_a_mismatched_quantized_tensor_is_refused_by_name_before_any_weight_is_read(
    change, message, tmp_path, no_weight_read
):
    model_dir, _, _ = model_pair(tmp_path, ct_config("pack-quantized", 4, 32, False))
    _edit(model_dir, change)
    with pytest.raises(ValueError, match=message):
        make_engine(model_dir)


def test_a_stored_shape_that_differs_is_refused_naming_the_layer(tmp_path):
    model_dir, _, _ = model_pair(tmp_path, ct_config("pack-quantized", 4, 32))
    _edit(model_dir, lambda t: t.update({f"{LAYER}.weight_shape": torch.tensor([64, 96])}))
    with pytest.raises(ValueError, match=rf"layer {LAYER}: weight_shape says \(64, 96\)"):
        make_engine(model_dir)


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    model_dir, _, _ = model_pair(tmp_path, ct_config("pack-quantized", 4, 32))
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"tensor \S+ does not fit its byte range"):
        make_engine(model_dir)


REFUSED = {
    "3-bit": ({"num_bits": 3}, "3-bit weights are not run; 4- and 8-bit ones are"),
    "2-bit": ({"num_bits": 2}, "2-bit weights are not run"),
    "float-weights": ({"type": "float"}, "float weights are not read"),
    "block-strategy": ({"strategy": "block"}, "weight strategy 'block' is not read"),
    "dynamic-weights": ({"dynamic": True}, "dynamic weight scales are not read"),
}


@pytest.mark.parametrize("change, message", REFUSED.values(), ids=REFUSED)
def test_variants_not_run_are_refused_by_name(change, message):
    config = ct_config("pack-quantized", 4, 32)
    config["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(ValueError, match=message):
        CompressedTensors().parse(config)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized - 4-bit float weights"),
        ({"format": "float-quantized"}, "float-quantized with 4-bit int weights is not read"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config: 2:4"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme: FP8/int8 KV"),
        ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ],
)
def test_formats_and_extras_not_read_are_refused_by_name(change, message):
    config = ct_config("pack-quantized", 4, 32)
    if "format" in change:
        config["config_groups"]["group_0"]["format"] = change["format"]
    else:
        config.update(change)
    with pytest.raises(ValueError, match=message):
        CompressedTensors().parse(config)


def test_static_or_asymmetric_activations_are_refused_with_the_scheme_that_runs():
    config = ct_config("int-quantized", 8, None, activations=True)
    config["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    with pytest.raises(ValueError, match="dynamic symmetric per-token int8 \\(W8A8\\) is"):
        CompressedTensors().parse(config)
    config = ct_config("pack-quantized", 4, 32, activations=True)
    with pytest.raises(ValueError, match="int8 activations need symmetric per-channel 8-bit"):
        CompressedTensors().parse(config)


def test_each_built_layer_gives_its_freed_temporaries_back(tmp_path, monkeypatch):
    """The heap is trimmed after every quantized layer is built (loader/heap.py): glibc
    otherwise keeps the layers' freed temporaries in RssAnon, which a load is held to."""
    from tokenmill.engine.loader import heap
    from tokenmill.engine.quant.checkpoint import loading

    calls = []
    monkeypatch.setattr(loading, "return_freed_heap", lambda: calls.append(1))
    model_dir, _, _ = model_pair(tmp_path, ct_config("pack-quantized", 4, 32))
    make_engine(model_dir)
    assert len(calls) == 8  # 2 layers x (qkv, o, gate_up, down)
    heap.return_freed_heap()  # and the real one runs here (a no-op without glibc)
