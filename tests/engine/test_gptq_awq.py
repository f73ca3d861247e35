"""GPTQ (v1 and v2, 4- and 8-bit, act-order) and AWQ GEMM checkpoints, written by the
tests' packers from the formats' published layouts: read exactly, and an fp32 engine over
them computes the dense fp32 model of their dequantized weights."""

from __future__ import annotations

import pytest
import torch
from hf_models import build_hf_model, make_engine, save_char_tokenizer
from quantized_checkpoints import act_order, awq_layer, gptq_layer, quantize_int, write_quantized
from reference_quantizers import AUTO_ROUND_CASES
from test_compressed_tensors import (  # no_weight_read: a fixture these tests use
    FLOAT_LAYERS,
    _edit,
    assert_same_model,
    no_weight_read,  # noqa: F401
)

from tokenmill.engine.quant.checkpoint.awq import AWQ
from tokenmill.engine.quant.checkpoint.gptq import GPTQ
from tokenmill.engine.quant.checkpoint.layers import (
    ExactIntLinear,
    PermutedInput,
    build_layer,
)
from tokenmill.engine.quant.checkpoint.weights import IntWeight
from tokenmill.engine.quant.gguf_linear import RowConcat
from tokenmill.engine.quant.int4 import Int4Linear


def gptq_settings(bits=4, group_size=32, sym=False, desc_act=False, layout="gptq", **extra):
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": layout,
        "damp_percent": 0.01,
        "true_sequential": True,
        **extra,
    }


AWQ_SETTINGS = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 32,
    "zero_point": True,
    "version": "gemm",
}


def write_gptq(tmp_path, settings, **model):
    bits, group = settings["bits"], settings["group_size"]
    layout = "v1" if settings["checkpoint_format"] == "gptq" else "v2"
    group = None if group == -1 else group
    seeds = iter(range(1000))

    def quantize(layer, tensor):
        if layer == "lm_head":
            return None
        if settings["desc_act"]:
            weight = act_order(tensor, bits, group, settings["sym"], seed=next(seeds))
        else:
            weight = quantize_int(tensor, bits, group, settings["sym"])
        if layout == "v1" and weight.zero is not None:
            # v1 cannot store a zero point of 0 (it reads back as 2^bits): AutoGPTQ's bug,
            # tested on its own below.
            weight.zero = weight.zero.clamp(min=1 - (1 << (bits - 1)))
        weight.scale = weight.scale.half()
        return weight

    return _write(tmp_path, settings, quantize, lambda w: gptq_layer(w, layout), **model)


def _write(tmp_path, settings, quantize, layer_tensors, **model):
    build_hf_model("llama", tmp_path / "float", **model)
    save_char_tokenizer(tmp_path / "float")
    layers = write_quantized(
        tmp_path / "float", tmp_path / "q", tmp_path / "dense", settings, quantize, layer_tensors
    )
    return tmp_path / "q", tmp_path / "dense", layers


GPTQ_VARIANTS = {
    "v1-4bit-asym-g32": (gptq_settings(), {}),
    "v1-4bit-sym-g32": (gptq_settings(sym=True), {}),
    "v2-4bit-asym-act-order": (gptq_settings(desc_act=True, layout="gptq_v2"), {}),
    "v1-4bit-act-order-per-channel": (gptq_settings(group_size=-1, desc_act=True), {}),
    "v2-8bit-sym-g32": (gptq_settings(bits=8, sym=True, layout="gptq_v2"), {}),
    "v1-8bit-asym-g64": (gptq_settings(bits=8, group_size=64), {}),
    "v1-4bit-ragged-g128": (
        gptq_settings(group_size=128, sym=True),
        dict(hidden_size=192, intermediate_size=320),
    ),
}


@pytest.mark.parametrize("settings, model", GPTQ_VARIANTS.values(), ids=GPTQ_VARIANTS)
def test_gptq_fp32_engine_is_the_dense_model_of_its_dequantized_weights(settings, model, tmp_path):
    model_dir, dense_dir, layers = write_gptq(tmp_path, settings, **model)
    assert len(layers) == 14
    engine = make_engine(model_dir)
    modules = list(engine.runner.model.model.layers[0].modules())
    # Fused parts with act-order groups of their own run side by side (q, k, v; gate, up);
    # per channel there is one group, and the order changes nothing.
    split = settings["desc_act"] and settings["group_size"] != -1
    assert sum(isinstance(m, ExactIntLinear) for m in modules) == 4 + 3 * split
    assert_same_model(model_dir, dense_dir)


def test_awq_fp32_engine_is_the_dense_model_of_its_dequantized_weights(tmp_path):
    def quantize(layer, tensor):
        if layer == "lm_head":
            return None
        weight = quantize_int(tensor, 4, 32, symmetric=False)
        weight.scale = weight.scale.half()
        return weight

    model_dir, dense_dir, layers = _write(tmp_path, AWQ_SETTINGS, quantize, awq_layer)
    engine = make_engine(model_dir)
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, ExactIntLinear)
    assert isinstance(engine.runner.model.lm_head, FLOAT_LAYERS)
    assert_same_model(model_dir, dense_dir)


def test_gptq_v1_reads_each_stored_zero_point_plus_one_as_autogptq_does():
    """v1 stores z - 1 masked to the field: a zero point of 0 is stored as 15 and read
    back as 16 - AutoGPTQ's kernels' reading, kept so its checkpoints compute what they
    computed there; v2 stores z."""
    weight = quantize_int(torch.randn(16, 64), 4, 32, symmetric=False)
    weight.zero[0, 0] = -8  # unsigned 0
    reader = GPTQ().parse(gptq_settings())
    decoded = reader.decode(reader.layer_scheme, gptq_layer(weight, "v1"), 16, 64)
    assert int(decoded.zero[0, 0]) == 8  # unsigned 16
    assert torch.equal(decoded.zero[1:], weight.zero[1:])
    v2 = GPTQ().parse(gptq_settings(layout="gptq_v2"))
    assert torch.equal(
        v2.decode(v2.layer_scheme, gptq_layer(weight, "v2"), 16, 64).zero, weight.zero
    )


def test_awq_nibble_order_is_interleaved():
    """Field i of each word holds output 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]."""
    weight = quantize_int(torch.randn(16, 64), 4, 32, symmetric=False)
    weight.q[:, 0] = (torch.arange(16) % 16 - 8).to(torch.int8)  # output o holds o - 8
    packed = awq_layer(weight)["qweight"][0, 0].item() & 0xFFFFFFFF
    fields = [(packed >> (4 * i)) & 15 for i in range(8)]
    assert fields == [0, 2, 4, 6, 1, 3, 5, 7]
    reader = AWQ().parse(AWQ_SETTINGS)
    decoded = reader.decode(reader.layer_scheme, awq_layer(weight), 16, 64)
    assert torch.equal(decoded.q, weight.q.to(torch.int16))


def test_act_order_layers_in_bf16_run_the_int4_kernel_part_by_part():
    """A fused q/k/v whose parts have their own act-order groups: one Int4Linear per part,
    each over its inputs in group order."""
    parts = [act_order(torch.randn(32, 64), 4, 32, True, seed=s) for s in range(3)]
    scheme = GPTQ().parse(gptq_settings(desc_act=True, sym=True)).layer_scheme
    layer = build_layer(parts, [scheme] * 3, None, dtype=torch.bfloat16)
    assert isinstance(layer, RowConcat)
    assert all(
        isinstance(p, PermutedInput) and isinstance(p.layer, Int4Linear) for p in layer.parts
    )
    x = torch.randn(4, 64)
    want = x.double() @ torch.cat([p.dequantize() for p in parts]).double().t()
    assert float((layer(x.bfloat16()).double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize(
    "settings, message",
    [
        (gptq_settings(bits=3), "GPTQ with 3-bit weights is not run"),
        (gptq_settings(bits=2), "GPTQ with 2-bit weights is not run"),
        (gptq_settings(layout="marlin"), "GPTQ checkpoint_format 'marlin' is not read"),
        (gptq_settings(pack_dtype="int16"), "GPTQ pack_dtype int16 is not read"),
        ({**AWQ_SETTINGS, "version": "gemv"}, "AWQ version gemv packs its weights"),
        ({**AWQ_SETTINGS, "version": "gemv_fast"}, "AWQ version gemv_fast packs"),
        ({**AWQ_SETTINGS, "version": "marlin"}, "AWQ version marlin packs"),
        ({**AWQ_SETTINGS, "bits": 8}, "AWQ with 8-bit weights is not run"),
        ({**AWQ_SETTINGS, "zero_point": False}, "AWQ without zero points is not read"),
    ],
)
def test_variants_not_run_are_refused_by_name(settings, message):
    fmt = GPTQ() if settings["quant_method"] == "gptq" else AWQ()
    with pytest.raises(ValueError, match=message):
        fmt.parse(settings)


LAYER = "model.layers.1.mlp.down_proj"  # 64 outputs, 128 inputs
GPTQ_BAD_TENSORS = {
    "missing-scales": (
        lambda t: t.pop(f"{LAYER}.scales"),
        rf"missing {LAYER}\.scales \(the scales\)",
    ),
    "codes-dtype": (
        lambda t: t.update({f"{LAYER}.qweight": t[f"{LAYER}.qweight"].to(torch.int64)}),
        rf"{LAYER}\.qweight is int64, expected int32",
    ),
    "truncated-codes": (
        lambda t: t.update({f"{LAYER}.qweight": t[f"{LAYER}.qweight"][:8]}),
        rf"{LAYER}\.qweight has shape \(8, 64\), expected \(16, 64\)",
    ),
    "zero-points-shape": (
        lambda t: t.update({f"{LAYER}.qzeros": t[f"{LAYER}.qzeros"][:2]}),
        rf"{LAYER}\.qzeros has shape \(2, 8\), expected \(4, 8\)",
    ),
    "missing-zero-points": (
        lambda t: t.pop(f"{LAYER}.qzeros"),
        rf"missing {LAYER}\.qzeros \(the zero points\)",
    ),
}


@pytest.mark.usefixtures("no_weight_read")
@pytest.mark.parametrize("change, message", GPTQ_BAD_TENSORS.values(), ids=GPTQ_BAD_TENSORS)
def test_a_mismatched_gptq_tensor_is_refused_by_name_before_any_weight_is_read(
    change, message, tmp_path
):
    model_dir, _, _ = write_gptq(tmp_path, gptq_settings())
    _edit(model_dir, change)
    with pytest.raises(ValueError, match=message):
        make_engine(model_dir)


def test_a_gptq_g_idx_naming_a_group_that_is_not_there_is_refused_naming_the_layer(tmp_path):
    model_dir, _, _ = write_gptq(tmp_path, gptq_settings(desc_act=True))
    _edit(model_dir, lambda t: t[f"{LAYER}.g_idx"].__setitem__(0, 9))
    with pytest.raises(ValueError, match=rf"layer {LAYER}: g_idx names groups outside 0\.\.3"):
        make_engine(model_dir)


@pytest.mark.usefixtures("no_weight_read")
def test_a_mismatched_awq_tensor_is_refused_by_name_before_any_weight_is_read(tmp_path):
    def quantize(layer, tensor):
        return None if layer == "lm_head" else quantize_int(tensor, 4, 32, symmetric=False)

    model_dir, _, _ = _write(tmp_path, AWQ_SETTINGS, quantize, awq_layer)
    _edit(model_dir, lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"].t()}))
    with pytest.raises(
        ValueError, match=rf"{LAYER}\.scales has shape \(64, 4\), expected \(4, 64\)"
    ):
        make_engine(model_dir)


@pytest.fixture(scope="session")
def auto_round_packed():
    from reference_quantizers import auto_round_packed

    return auto_round_packed()


@pytest.mark.parametrize("case", AUTO_ROUND_CASES)
def test_our_packers_write_auto_rounds_tensors_byte_for_byte_and_we_decode_them(
    case, auto_round_packed
):
    """auto-round's own GPTQ v1 and AWQ GEMM packers, run here (reference_quantizers), on
    known codes, zero points and scales: our tests' packers write the same bytes, and the
    readers decode auto-round's tensors to exactly those values."""
    stored = auto_round_packed[case]
    bits = 8 if case == "gptq8" else 4
    half = 1 << (bits - 1)
    weight = IntWeight(stored["codes"] - half, stored["scales"], stored["zeros"] - half, 32, bits)
    if case == "awq4":
        ours, reader = awq_layer(weight), AWQ().parse(AWQ_SETTINGS)
    else:
        ours, reader = gptq_layer(weight, "v1"), GPTQ().parse(gptq_settings(bits=bits))
    assert torch.equal(ours["qweight"], stored["qweight"])
    assert torch.equal(ours["qzeros"], stored["qzeros"])
    assert torch.equal(ours["scales"], stored["scales_out"])
    theirs = {
        "qweight": stored["qweight"],
        "qzeros": stored["qzeros"],
        "scales": stored["scales_out"],
    }
    decoded = reader.decode(reader.layer_scheme, theirs, 64, 128)
    assert torch.equal(decoded.dequantize(), weight.dequantize())
    groups = torch.arange(128) // 32
    expected = (stored["codes"] - stored["zeros"][:, groups]).float() * stored["scales"].float()[
        :, groups
    ]
    assert torch.equal(decoded.dequantize(), expected)
