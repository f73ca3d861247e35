"""Gemma 3's SigLIP tower and projector alone against transformers' SiglipVisionModel and
Gemma3MultiModalProjector on the same random weights (std 0.2: large enough that a tanh
GELU is told from the exact one), several images in one call: as built (F.linear),
oneDNN-packed with the residual adds and the GELU inside the matmuls (as the engine loads
it), and in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.engine.models.gemma3_vision import _tower_name
from tokenmill.engine.models.siglip import Gemma3Projector, SiglipVisionTower, VisionConfig
from tokenmill.engine.quant.packed_linear import pack_linear_layers, packs_dtype

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)
TEXT_HIDDEN = 24
TOKENS_PER_IMAGE = 4  # the 4 x 4 patch grid pooled 2 x 2


@pytest.fixture(scope="module")
def towers():
    from transformers import Gemma3Config, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    hf_config = SiglipVisionConfig(**SHAPE, vision_use_head=False)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(17)
    hf_tower = SiglipVisionModel(hf_config).eval()
    text = dict(hidden_size=TEXT_HIDDEN, num_hidden_layers=1, num_attention_heads=2)
    outer = Gemma3Config(
        vision_config=hf_config.to_dict(), text_config=text, mm_tokens_per_image=TOKENS_PER_IMAGE
    )
    hf_projector = Gemma3MultiModalProjector(outer).eval()
    with torch.no_grad():
        for module in (hf_tower, hf_projector):
            for param in module.parameters():
                param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
    config = VisionConfig(**SHAPE)
    tower = SiglipVisionTower(config).eval()
    projector = Gemma3Projector(config, TEXT_HIDDEN, TOKENS_PER_IMAGE).eval()
    state = {_tower_name(name): t for name, t in hf_tower.state_dict().items()}
    tower.load_state_dict(state, strict=True)
    projector.load_state_dict(
        {
            "mm_input_projection_weight": hf_projector.mm_input_projection_weight,
            "mm_soft_emb_norm_weight": hf_projector.mm_soft_emb_norm.weight,
        },
        strict=True,
    )

    def hf(pixels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf_projector(hf_tower(pixel_values=pixels).last_hidden_state)

    def ours(pixels: torch.Tensor, encoder=tower, pooler=projector) -> torch.Tensor:
        with torch.no_grad():
            return pooler(encoder(pixels))

    return hf, ours, (tower, projector), (hf_tower, hf_projector)


def _pixels(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(count, 3, 28, 28, generator=g) * 2 - 1


def test_tower_and_projector_equal_transformers(towers):
    hf, ours, _, _ = towers
    pixels = _pixels(3, 1)
    want = hf(pixels)
    got = ours(pixels)
    assert got.shape == want.shape == (3, TOKENS_PER_IMAGE, TEXT_HIDDEN)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_packed_tower_with_fused_post_ops_equals_transformers(towers):
    """As the engine loads it: q, k, v, out_proj, fc1 and fc2 packed per layer, the
    residual adds and the tanh GELU inside the matmuls."""
    hf, ours, (tower, _), _ = towers
    packed = copy.deepcopy(tower)
    expected = 2 * 6 if packs_dtype(torch.float32) else 0  # a torch without oneDNN: 0
    assert pack_linear_layers(packed, dtype=torch.float32, device=torch.device("cpu")) == expected
    pixels = _pixels(3, 2)
    torch.testing.assert_close(ours(pixels, packed), hf(pixels), atol=2e-5, rtol=1e-4)


def test_bf16_tower_is_as_close_to_fp32_as_transformers_bf16(towers):
    """In bf16, packed where oneDNN packs it: the error against transformers' fp32 output
    is within 1.5x transformers' own bf16 error."""
    hf, ours, (tower, projector), (hf_tower, hf_projector) = towers
    pixels = _pixels(4, 3)
    want = hf(pixels)
    hf_tower16 = copy.deepcopy(hf_tower).to(torch.bfloat16)
    hf_projector16 = copy.deepcopy(hf_projector).to(torch.bfloat16)
    with torch.no_grad():
        theirs = hf_projector16(hf_tower16(pixel_values=pixels.bfloat16()).last_hidden_state)
    ours16 = copy.deepcopy(tower).to(torch.bfloat16)
    pack_linear_layers(ours16, dtype=torch.bfloat16, device=torch.device("cpu"))
    got = ours(pixels.bfloat16(), ours16, copy.deepcopy(projector).to(torch.bfloat16))
    theirs_error = (theirs.float() - want).abs().mean()
    our_error = (got.float() - want).abs().mean()
    assert our_error <= 1.5 * theirs_error, (our_error, theirs_error)


@pytest.mark.skipif(not packs_dtype(torch.bfloat16), reason="this torch has no oneDNN bf16")
def test_packed_bf16_fc1_gelu_is_the_separate_ops_to_an_ulp(monkeypatch):
    """A packed bf16 fc1 with the tanh GELU runs the plain matmul, then the native GELU
    over its product in place (gelu.c): within one bf16 ulp of F.gelu over the same
    product, where PyTorch's 1 + tanh(u) keeps its digits (x >= -4)."""
    from tokenmill.engine.kernels import elementwise
    from tokenmill.engine.models.fused_linear import fused_linear

    torch.manual_seed(5)
    layers = torch.nn.ModuleList([torch.nn.Linear(64, 200).to(torch.bfloat16)])
    with torch.no_grad():
        layers[0].weight.normal_(0, 0.5)
    assert pack_linear_layers(layers, dtype=torch.bfloat16, device=torch.device("cpu")) == 1
    fc1 = layers[0]  # the packed module
    native = []
    monkeypatch.setattr(
        elementwise, "gelu_tanh_", lambda x, _f=elementwise.gelu_tanh_: native.append(1) or _f(x)
    )
    x = torch.randn(3, 37, 64).bfloat16()
    with torch.no_grad():
        product = fc1(x)
        got = fused_linear(fc1, x, activation="gelu_pytorch_tanh")
    assert native == [1]
    expected = torch.nn.functional.gelu(product, approximate="tanh")
    assert got.shape == (3, 37, 200) and float(product.abs().max()) > 8
    ulps = (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulps[product >= -4].max()) <= 1
    assert float((got.float() - expected.float()).abs().max()) < 1e-3


def test_bf16_tower_runs_its_adds_norms_and_gelu_natively(towers, monkeypatch):
    """In bf16 each layer's two residual adds run with the LayerNorm after them (the next
    layer's first, the tower's last) and fc1's GELU as native passes, and the tower's
    output is the PyTorch ops' (native kernels off) to bf16 rounding."""
    from tokenmill.engine.kernels import elementwise

    hf, ours, (tower, projector), _ = towers
    pixels = _pixels(3, 8).bfloat16()
    tower16 = copy.deepcopy(tower).to(torch.bfloat16)
    pack_linear_layers(tower16, dtype=torch.bfloat16, device=torch.device("cpu"))
    projector16 = copy.deepcopy(projector).to(torch.bfloat16)
    calls = {"add_layer_norm": 0, "gelu_tanh_": 0}
    for name in calls:

        def counted(*args, _name=name, _original=getattr(elementwise, name)):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(elementwise, name, counted)
    got = ours(pixels, tower16, projector16)
    layers = SHAPE["num_hidden_layers"]
    assert calls == {"add_layer_norm": 2 * layers, "gelu_tanh_": layers}
    monkeypatch.setattr(elementwise, "supports", lambda x: False)
    torch_ops = ours(pixels, tower16, projector16)
    assert calls == {"add_layer_norm": 2 * layers, "gelu_tanh_": layers}
    assert (got.float() - torch_ops.float()).abs().mean() <= 0.01 * torch_ops.float().abs().mean()
    want = hf(pixels.float())  # fp32: both as far from it, to rounding
    our_error, torch_error = (
        (got.float() - want).abs().mean(),
        (torch_ops.float() - want).abs().mean(),
    )
    assert our_error <= 1.25 * torch_error, (our_error, torch_error)
