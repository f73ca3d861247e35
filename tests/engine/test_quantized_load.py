"""A quantized load holds the float weights of a layer or so at a time, not the model's:
int4 swaps each decoder linear layer as the load fills it, int8 frees each float layer
as it is quantized after its calibration pass - with the values of quantizing after the
whole load."""

from __future__ import annotations

import weakref

import pytest
import torch
from hf_models import build_hf_model, make_engine, run_all
from test_hf_parity import mixed_prompts
from test_quantized_model import PARAMS

from tokenmill.engine.loader.tensor_plan import build_on_meta
from tokenmill.engine.quant import int8, quantized_targets
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.int8 import Int8Linear
from tokenmill.engine.worker import build
from tokenmill.engine.worker.memory import load_bytes

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", path, num_hidden_layers=NUM_LAYERS)
    return path


def _decoder_linears(model) -> list[torch.nn.Linear]:
    return [linear for _, _, linear in quantized_targets(model)]


def _float_bytes(model) -> int:
    """Bytes of the decoder's float linear weights that have memory now."""
    return sum(
        lin.weight.numel() * lin.weight.element_size()
        for lin in _decoder_linears(model)
        if not lin.weight.is_meta
    )


def test_int4_swaps_each_decoder_layer_as_the_load_fills_it(model_dir, monkeypatch):
    """At every module the load completes, the float decoder weights alive are at most
    one fused layer being filled; none is left for quantize_model after the load."""
    seen = {"peak": 0}
    on_filled = build._on_filled

    def watched(quantization):
        inner = on_filled(quantization)

        def call(model, name):
            inner(model, name)
            seen["peak"] = max(seen["peak"], _float_bytes(model))

        return call

    left = []
    quantize_model = build.quantize_model
    monkeypatch.setattr(build, "_on_filled", watched)
    monkeypatch.setattr(
        build,
        "quantize_model",
        lambda model, *a, **k: (
            left.append(len(_decoder_linears(model))) or quantize_model(model, *a, **k)
        ),
    )
    engine = make_engine(model_dir, quantization="int4")
    model = engine.runner.model
    assert left == [0]
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * NUM_LAYERS
    config = engine.runner.config
    gate_up_bytes = 2 * config.intermediate_size * config.hidden_size * 4  # fp32
    assert seen["peak"] <= gate_up_bytes, seen


def test_int4_quantized_as_it_loads_equals_quantized_after_the_load(model_dir, monkeypatch):
    prompts = mixed_prompts(96, seed=3)
    engine = make_engine(model_dir, quantization="int4")
    outputs = run_all(engine, prompts, PARAMS)
    with monkeypatch.context() as patch:  # the path before: the whole float model first
        patch.setattr(build, "load_quantizer", lambda quantization: None)
        after = make_engine(model_dir, quantization="int4")
    pairs = list(zip(engine.runner.model.modules(), after.runner.model.modules()))
    int4_pairs = [(a, b) for a, b in pairs if isinstance(a, Int4Linear)]
    assert len(int4_pairs) == 4 * NUM_LAYERS
    for a, b in int4_pairs:
        assert isinstance(b, Int4Linear)
        assert torch.equal(a.packed_weight, b.packed_weight)
        assert torch.equal(a.scales_and_zeros, b.scales_and_zeros)
    reference = run_all(after, prompts, PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert [o.prompt_logprobs for o in outputs] == [o.prompt_logprobs for o in reference]


def test_int8_frees_each_float_layer_as_it_is_quantized(model_dir, monkeypatch):
    """Each layer's float weight is gone once its int8 layer replaces it: when the k-th
    layer is quantized, k - 1 of the float layers are freed (not all kept to the end)."""
    alive_at_each: list[int] = []
    refs: list[weakref.ref] = []
    quantize_model = build.quantize_model

    def remember(model, *args, **kwargs):
        refs.extend(weakref.ref(linear) for linear in _decoder_linears(model))
        return quantize_model(model, *args, **kwargs)

    from_float = Int8Linear.from_float.__func__

    def counted(cls, *args, **kwargs):
        alive_at_each.append(sum(ref() is not None for ref in refs))
        return from_float(cls, *args, **kwargs)

    monkeypatch.setattr(build, "quantize_model", remember)
    monkeypatch.setattr(int8.Int8Linear, "from_float", classmethod(counted))
    make_engine(model_dir, quantization="int8")
    num_layers = 4 * NUM_LAYERS
    assert len(refs) == num_layers
    assert alive_at_each == list(range(num_layers, 0, -1))
    assert all(ref() is None for ref in refs)


def test_the_memory_plan_counts_int4_layers_quantized_plus_one_float_layer(model_dir):
    """The plan's weights for int4 are what its layers take once swapped (each as
    Int4Linear counts itself) plus the largest float layer, alive while it fills - not
    the float model, which no longer is in memory at once (and would refuse models that
    fit)."""
    engine = make_engine(model_dir, quantization="int4")
    model = engine.runner.model
    int4_bytes = sum(m.weight_bytes for m in model.modules() if isinstance(m, Int4Linear))
    config = engine.runner.config
    float_model = load_bytes(config, torch.float32)
    floats = [
        p.numel() * 4
        for _, _, linear in quantized_targets(build_on_meta(config))
        for p in linear.parameters()
    ]
    largest = 2 * config.intermediate_size * config.hidden_size * 4  # the fused gate_up
    assert max(floats) == largest
    want = float_model - sum(floats) + int4_bytes + largest
    assert engine.memory.weight_bytes == want
    assert want < float_model / 2
