"""Qwen2.5-VL's vision tower against transformers' Qwen2_5_VisionTransformerPretrainedModel
on the same random weights (fp32, std ~0.05): single images and several images of
different sizes in one call, windows partial and whole, full-attention blocks among
window blocks; and the processor's patches of real images through both."""

from __future__ import annotations

import pytest
import torch
from vision_models import png_bytes

from tokenmill.engine.loader.images import decode_image
from tokenmill.engine.loader.qwen_images import DynamicImageProcessor
from tokenmill.engine.models.qwen2_5_vision import (
    QwenVisionConfig,
    QwenVisionTower,
    num_image_tokens,
    tower_layout,
    tower_name,
)

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


def test_window_layout_equals_transformers():
    from transformers.vision_utils import get_vision_window_index

    config = QwenVisionConfig(**{**VISION, "fullatt_block_indexes": (1, 3)})
    grids = [(1, 6, 10), (1, 8, 8), (1, 2, 2)]
    index, cu_window = get_vision_window_index(torch.tensor(grids), 2, 16, 4)
    layout = tower_layout(config, grids, torch.device("cpu"))
    assert layout.window_order.tolist() == index.tolist()
    lengths = sorted((cu_window[1:] - cu_window[:-1]).tolist())
    assert sorted(int(rows.shape[1]) for rows in layout.windows.groups for _ in rows) == lengths


def test_videos_and_bad_windows_are_refused_by_name():
    config = QwenVisionConfig(**{**VISION, "fullatt_block_indexes": (1, 3)})
    with pytest.raises(ValueError, match="2 frames is a video"):
        tower_layout(config, [(2, 4, 4)], torch.device("cpu"))
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
    with torch.no_grad():
        want = hf(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
    assert got.shape == want.shape == (15 + 1 + 8, 24)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
