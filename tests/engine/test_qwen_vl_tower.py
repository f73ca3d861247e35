"""Qwen2.5-VL's vision tower against transformers' Qwen2_5_VisionTransformerPretrainedModel
on the same random weights (fp32, std ~0.05): single images and several images of
different sizes in one call, windows partial and whole, full-attention blocks among
window blocks; and the processor's patches of real images through both."""

from __future__ import annotations

import copy

import pytest
import torch
from vision_models import png_bytes

from tokenmill.engine.loader.images import decode_image
from tokenmill.engine.loader.qwen_images import DynamicImageProcessor
from tokenmill.engine.models.qwen2_5_vision import (
    QwenVisionConfig,
    QwenVisionTower,
    num_image_tokens,
    tower_name,
)
from tokenmill.engine.models.vision_segments import tower_layout
from tokenmill.engine.quant.packed_linear import pack_linear_layers, packs_dtype

# Patches of 4 px merged 2 x 2; windows of 16 px = 2 x 2 merged tokens; blocks 1 and 3
# attend across the whole image, 0 and 2 within windows.
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    in_channels=3,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    out_hidden_size=24,
    fullatt_block_indexes=[1, 3],
)


@pytest.fixture(scope="module")
def towers():
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    hf_config = Qwen2_5_VLVisionConfig(**VISION)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(99)
    hf = Qwen2_5_VisionTransformerPretrainedModel(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.05 if param.dim() > 1 else 0.3)
    ours = QwenVisionTower(QwenVisionConfig(**{**VISION, "fullatt_block_indexes": (1, 3)})).eval()
    state = {tower_name(name): tensor for name, tensor in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return hf, ours


def _hf(hf, patches, grids):
    with torch.no_grad():
        out = hf(patches, grid_thw=torch.tensor(grids))
    return out.pooler_output


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 4)],  # one window
        [(1, 8, 8)],  # four whole windows
        [(1, 6, 10)],  # partial windows on the right and bottom
        [(1, 2, 14)],  # one row of windows
        [(1, 6, 10), (1, 8, 8), (1, 2, 2), (1, 6, 10)],  # several, two of one size
    ],
)
def test_tower_equals_transformers(towers, grids):
    hf, ours = towers
    g = torch.Generator().manual_seed(len(grids) * 100 + grids[0][1])
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4, generator=g)
    want = _hf(hf, patches, grids)
    with torch.no_grad():
        got = ours(patches, grids)
    assert got.shape == want.shape == (sum(h * w // 4 for _, h, w in grids), 24)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_batch_equals_its_images_one_by_one(towers):
    """Images batched in one call come out as each does alone (no image sees another)."""
    _, ours = towers
    grids = [(1, 6, 10), (1, 4, 4), (1, 8, 2)]
    g = torch.Generator().manual_seed(5)
    patches = torch.randn(sum(h * w for _, h, w in grids), 96, generator=g)
    with torch.no_grad():
        batched = ours(patches, grids)
        alone, first = [], 0
        for grid in grids:
            count = grid[1] * grid[2]
            alone.append(ours(patches[first : first + count], [grid]))
            first += count
    torch.testing.assert_close(batched, torch.cat(alone), atol=1e-6, rtol=0)


def test_processor_patches_through_both_towers(towers):
    hf, ours = towers
    processor = DynamicImageProcessor(
        min_pixels=8 * 8, max_pixels=40 * 40, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    images = [decode_image(png_bytes(w, h, seed=w)) for w, h in [(50, 37), (13, 30), (24, 24)]]
    processed = [processor(image) for image in images]
    patches = torch.cat([p for p, _ in processed])
    grids = [grid for _, grid in processed]
    want = _hf(hf, patches, grids)
    with torch.no_grad():
        got = ours(patches, grids)
    config = ours.config
    assert got.shape[0] == sum(num_image_tokens(config, g) for g in grids)
    assert [num_image_tokens(config, g) for g in grids] == [
        processor.num_tokens(*image.size) for image in images
    ]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_windows_are_transformers_windows_each_read_in_place():
    """The same windows as transformers' (sets of merged tokens), in an order of our own:
    by length, so every window block reads its windows in place (no gather); the
    full-attention segments hold each image's patches."""
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 6, 10), (1, 8, 8), (1, 2, 2), (1, 6, 10)]
    index, cu_window = get_vision_window_index(torch.tensor(grids), 2, 16, 4)
    lengths = (cu_window[1:] - cu_window[:-1]) // 4  # in merged tokens
    theirs = sorted(tuple(sorted(w.tolist())) for w in index.split(lengths.tolist()) if len(w))
    layout = tower_layout(grids, merge_size=2, window_tokens=2, device=torch.device("cpu"))
    order = layout.window_order.tolist()
    ours = []
    for group in layout.windows.groups:
        assert group.rows is None  # read in place
        for first in range(group.start, group.end, group.length):
            ours.append(tuple(sorted(order[first // 4 : (first + group.length) // 4])))
    assert sorted(ours) == theirs
    assert [(g.count, g.length) for g in layout.windows.groups] == [(3, 4), (6, 8), (8, 16)]
    tokens = [h * w // 4 for _, h, w in grids]
    firsts = [sum(tokens[:i]) for i in range(len(grids))]
    images = []
    for group in layout.images.groups:
        rows = group.rows if group.rows is not None else torch.arange(group.start, group.end)
        for patches in rows.view(group.count, group.length):
            assert patches[::4].tolist() == (patches[::4] // 4 * 4).tolist()  # whole groups
            images.append(sorted(order[p // 4] for p in patches[::4].tolist()))
    assert sorted(images) == sorted(
        list(range(first, first + n)) for first, n in zip(firsts, tokens)
    )


def test_one_window_length_is_one_view_of_the_call():
    """An image whose windows are all whole keeps transformers' order, as one segment group."""
    layout = tower_layout([(1, 8, 8)], merge_size=2, window_tokens=2, device=torch.device("cpu"))
    assert [(g.count, g.length, g.start) for g in layout.windows.groups] == [(4, 16, 0)]
    assert [(g.count, g.length, g.start) for g in layout.images.groups] == [(1, 64, 0)]


def test_the_packed_tower_with_fused_post_ops_equals_transformers(towers):
    """As the engine runs it: linear layers oneDNN-packed, each residual add, the SiLU, the
    gate-times-up and the merger's GELU inside the matmuls (fused_linear.py)."""
    hf, ours = towers
    packed = copy.deepcopy(ours)
    expected = 4 * 5 + 2 if packs_dtype(torch.float32) else 0  # a torch without oneDNN: 0
    assert pack_linear_layers(packed, dtype=torch.float32, device=torch.device("cpu")) == expected
    grids = [(1, 6, 10), (1, 8, 8), (1, 2, 2), (1, 6, 10)]
    g = torch.Generator().manual_seed(21)
    patches = torch.randn(sum(h * w for _, h, w in grids), 96, generator=g)
    want = _hf(hf, patches, grids)
    with torch.no_grad():
        got = packed(patches, grids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_videos_and_bad_windows_are_refused_by_name():
    with pytest.raises(ValueError, match="2 frames is a video"):
        tower_layout([(2, 4, 4)], merge_size=2, window_tokens=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="window_size 4 is under one merged token"):
        QwenVisionTower(QwenVisionConfig(**{**VISION, "window_size": 4}))


def test_qwen2_vl_tower_equals_transformers():
    """Qwen2-VL's tower: LayerNorms, an fc1 -> quick-GELU -> fc2 MLP, every block across
    the whole image - several images of different sizes in one call."""
    from transformers import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    from tokenmill.engine.models.qwen2_vl import parse_vision_config

    raw = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=24, patch_size=4)
    hf_config = Qwen2VLVisionConfig(**raw)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    hf = Qwen2VisionTransformerPretrainedModel(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.05 if param.dim() > 1 else 0.3)
    ours = QwenVisionTower(parse_vision_config(hf_config.to_dict())).eval()
    state = {tower_name(name): tensor for name, tensor in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    grids = [(1, 6, 10), (1, 2, 2), (1, 8, 4)]
    g = torch.Generator().manual_seed(9)
    patches = torch.randn(sum(h * w for _, h, w in grids), 96, generator=g)
    packed = copy.deepcopy(ours)
    pack_linear_layers(packed, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        want = hf(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
        got_packed = packed(patches, grids)  # the residual adds inside the matmuls
    assert got.shape == want.shape == (15 + 1 + 8, 24)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_packed, want, atol=2e-5, rtol=1e-4)


def test_without_the_native_kernels_the_tower_equals_transformers(towers, monkeypatch):
    """TOKENMILL_FUSED_OPS=0: the norms and the rotary in PyTorch ops, same outputs."""
    from tokenmill.engine.kernels import elementwise

    hf, ours = towers
    grids = [(1, 6, 10), (1, 2, 2), (1, 8, 8)]
    g = torch.Generator().manual_seed(8)
    patches = torch.randn(sum(h * w for _, h, w in grids), 96, generator=g)
    want = _hf(hf, patches, grids)
    monkeypatch.setenv("TOKENMILL_FUSED_OPS", "0")
    elementwise._library.cache_clear()
    try:
        assert not elementwise.supports(patches)
        with torch.no_grad():
            got = ours(patches, grids)
    finally:
        monkeypatch.delenv("TOKENMILL_FUSED_OPS")
        elementwise._library.cache_clear()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bf16_tower_is_as_close_to_fp32_as_transformers_bf16(towers):
    """In bf16 (packed where oneDNN packs it, post-ops fused, rotary in fp32) the tower's
    error against transformers' fp32 output is within 1.5x transformers' own bf16 error."""
    hf, ours = towers
    grids = [(1, 6, 10), (1, 8, 8), (1, 2, 2)]
    g = torch.Generator().manual_seed(13)
    patches = torch.randn(sum(h * w for _, h, w in grids), 96, generator=g)
    want = _hf(hf, patches, grids)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    pack_linear_layers(ours_bf16, dtype=torch.bfloat16, device=torch.device("cpu"))
    with torch.no_grad():
        theirs_error = (_hf(hf_bf16, patches.bfloat16(), grids).float() - want).abs().mean()
        our_error = (ours_bf16(patches.bfloat16(), grids).float() - want).abs().mean()
    assert our_error <= 1.5 * theirs_error, (our_error, theirs_error)
