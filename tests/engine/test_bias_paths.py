"""Every linear path a Llama layer can take applies its biases (attention_bias: q/k/v/o,
mlp_bias: gate/up/down): fp32 and bf16 through F.linear, oneDNN-packed weights and the
one-row packed matvec; int8 on the native kernel (its gate_up with the activation in the
epilogue) and on oneDNN; int4; a GGUF's own blocks; and under a LoRA wrapper.

Each layer of the built engine is run on random rows and held to the checkpoint's float
weights: its output must be far nearer the product with the bias than without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import build_hf_model
from model_fixtures import write_tiny_gguf
from safetensors.torch import load_file
from torch.nn import functional as F

from tokenmill.engine.api.llm import build_engine
from tokenmill.engine.loader.gguf_convert import convert_gguf
from tokenmill.engine.lora.layers import LoRALinear, LoRAStep
from tokenmill.engine.models.layers import GatedMLP
from tokenmill.engine.quant import int4, int8
from tokenmill.engine.quant.int4 import Int4Linear
from tokenmill.engine.quant.packed_linear import PackedLinear, packs_dtype
from tokenmill.engine.types.config import EngineConfig


def built_model(model_dir: Path, dtype: torch.dtype, **settings):
    config = EngineConfig(block_size=4, kv_cache_memory=4 << 20, **settings)
    engine = build_engine(model_dir, config, dtype=dtype, device=torch.device("cpu"))
    return engine.runner.model


def checkpoint_projections(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    """The float weights and biases of one decoder layer, fused as the engine fuses them."""
    t = load_file(model_dir / "model.safetensors")
    p = f"model.layers.{layer}"

    def fused(parent: str, parts: tuple[str, ...], kind: str) -> torch.Tensor:
        return torch.cat([t[f"{p}.{parent}.{part}_proj.{kind}"] for part in parts]).float()

    return {
        "qkv.weight": fused("self_attn", ("q", "k", "v"), "weight"),
        "qkv.bias": fused("self_attn", ("q", "k", "v"), "bias"),
        "o.weight": fused("self_attn", ("o",), "weight"),
        "o.bias": fused("self_attn", ("o",), "bias"),
        "gate_up.weight": fused("mlp", ("gate", "up"), "weight"),
        "gate_up.bias": fused("mlp", ("gate", "up"), "bias"),
        "down.weight": fused("mlp", ("down",), "weight"),
        "down.bias": fused("mlp", ("down",), "bias"),
    }


def assert_applies_bias(got: torch.Tensor, with_bias: torch.Tensor, without: torch.Tensor):
    """The output is far nearer the biased product than the unbiased one."""
    near = (got.float() - with_bias).norm()
    far = (got.float() - without).norm()
    assert near < 0.3 * far, f"{near:.3f} from the biased product, {far:.3f} from the unbiased"


def check_layer(
    model, model_dir: Path, dtype: torch.dtype, rows: int = 5, computed=lambda w: w
) -> list[type]:
    """Hold layer 1's projections and its whole MLP to the checkpoint; returns the kinds of
    linear module that ran. `computed(weight)`: the weight a path computes with (its
    dequantized values), where that differs from the checkpoint's by more than rounding."""
    ref = checkpoint_projections(model_dir, 1)
    ref = {k: computed(v) if k.endswith("weight") else v for k, v in ref.items()}
    layer = model.model.layers[1]
    gen = torch.Generator().manual_seed(0)
    # Small inputs: a quantized path's error scales with them, the bias's part does not.
    x = (0.2 * torch.randn(rows, ref["qkv.weight"].shape[1], generator=gen)).to(dtype)
    kinds = []
    for module, name in (
        (layer.self_attn.qkv_proj, "qkv"),
        (layer.self_attn.o_proj, "o"),
        (layer.mlp.gate_up_proj, "gate_up"),
        (layer.mlp.down_proj, "down"),
    ):
        weight, bias = ref[f"{name}.weight"], ref[f"{name}.bias"]
        inputs = (0.2 * torch.randn(rows, weight.shape[1], generator=gen)).to(dtype)
        with torch.inference_mode():
            got = module(inputs)
        assert_applies_bias(got, F.linear(inputs.float(), weight, bias), inputs.float() @ weight.T)
        kinds.append(type(module))
    mlp: GatedMLP = layer.mlp
    with torch.inference_mode():
        got = mlp(x)

    def reference_mlp(with_bias: bool) -> torch.Tensor:
        b = (lambda n: ref[f"{n}.bias"]) if with_bias else (lambda n: None)
        gate, up = F.linear(x.float(), ref["gate_up.weight"], b("gate_up")).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, ref["down.weight"], b("down"))

    assert_applies_bias(got, reference_mlp(True), reference_mlp(False))
    return kinds


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("biased-llama")
    build_hf_model("llama", model_dir, attention_bias=True, mlp_bias=True)
    return model_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed_linear", [True, False])
def test_float_paths_apply_biases(biased_llama, dtype, packed_linear):
    model = built_model(biased_llama, dtype, packed_linear=packed_linear)
    kinds = check_layer(model, biased_llama, dtype)
    one_row = check_layer(model, biased_llama, dtype, rows=1)  # bf16: the packed matvec
    assert kinds == one_row
    if packed_linear and packs_dtype(dtype):
        assert set(kinds) == {PackedLinear}
    else:
        assert all(issubclass(kind, torch.nn.Linear) for kind in kinds)


@pytest.mark.parametrize("kernel", ["native", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_applies_biases(biased_llama, kernel, dtype, monkeypatch):
    if kernel == "native" and int8.choose_kernel(128, 64) != "native":
        pytest.skip("the native int8 kernel is not built for this CPU")
    monkeypatch.setattr(int8, "choose_kernel", lambda *shape: kernel)
    model = built_model(biased_llama, dtype, quantization="int8")
    # Each kernel is a layer class of its own (int8.INT8_KERNELS).
    assert set(check_layer(model, biased_llama, dtype)) == {int8.INT8_KERNELS[kernel]}
    check_layer(model, biased_llama, dtype, rows=1)


def test_int4_applies_biases(biased_llama):
    def dequantized(weight: torch.Tensor) -> torch.Tensor:
        q, scale, minimum = int4.quantize_weight(weight, int4.GROUP_SIZE)
        groups = q.reshape(*scale.shape, -1).float()
        return (groups * scale[..., None] + minimum[..., None]).reshape(weight.shape)

    model = built_model(biased_llama, torch.bfloat16, quantization="int4")
    kinds = check_layer(model, biased_llama, torch.bfloat16, computed=dequantized)
    assert set(kinds) == {Int4Linear}


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_0"])
def test_gguf_blocks_apply_biases(quant_type, tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type=quant_type, biases=True)
    model_dir = convert_gguf(tiny.path, tmp_path / "model")
    model = built_model(model_dir, torch.float32, quantization="gguf")
    kinds = check_layer(model, model_dir, torch.float32)  # the GGUF's values, dequantized
    assert not any(issubclass(kind, (torch.nn.Linear, PackedLinear)) for kind in kinds)


def test_a_lora_wrapper_keeps_its_base_layers_bias(biased_llama):
    """With no adapter rows in the step, a wrapped layer computes its base, bias and all."""
    model = built_model(biased_llama, torch.float32)
    step = LoRAStep()
    for module in (model.model.layers[1].self_attn, model.model.layers[1].mlp):
        for name in [n for n, c in module.named_children() if n.endswith("_proj")]:
            setattr(module, name, LoRALinear(getattr(module, name), step, num_slots=2))
    assert set(check_layer(model, biased_llama, torch.float32)) == {LoRALinear}
