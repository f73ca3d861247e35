"""The vision towers alone, tokenmill's against transformers' on the same random weights
and pixels: seconds per image and per block, at the real models' widths with the depth
cut (the blocks are alike, so a block's time scales to the full depth).

    python benchmarks/vision_towers.py [--towers qwen2.5-vl,gemma3] [--dtypes float32,bfloat16]
                                       [--batches 1,8] [--depth 4] [--rounds 3]
                                       [--torch-profiler] [--no-pack]

Towers (the shapes of the models' own config.json, `depth` blocks):
  qwen2.5-vl  Qwen2.5-VL-3B's: width 1280, MLP 3420, 16 heads, 14 px patches merged 2 x 2,
              112 px windows, the last block of the cut attending across the whole image
              (as 7, 15, 23, 31 do in 32); images near 448 x 448 px, mixed aspect ratios
              (1,024 patches, 256 tokens each), the projection to 2,048 (the merger) included
  gemma3      Gemma 3 4B's SigLIP (So400m): width 1152, MLP 4304, 16 heads, 896 px in 14 px
              patches (4,096 a image), and its projector to 256 tokens of width 2,560

Each case builds transformers' module (sdpa attention) with random weights, loads the same
tensors into tokenmill's, and checks the two outputs agree before timing. tokenmill's
linear layers are oneDNN-packed as the engine loads them (`--no-pack`: F.linear). The two
alternate within each round (A B A B). The table gives medians over rounds of one call's
seconds per image, and per block and image (forward hooks on each block; "rest" is the
patch embedding, the layout and rotary tables, the merger or projector); then
transformers' time over tokenmill's, as the median of the rounds' ratios and as the
ratio of the best rounds.

A busy machine spreads the figures; compare ratios from one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# Below the front door: a kernel-level benchmark - it builds the towers' modules and calls
# them as the worker does, beside transformers' own.
from tokenmill.bench.tiny_vlm import GEMMA3_4B_VISION
from tokenmill.engine.models.gemma3_vision import _tower_name as siglip_tower_name
from tokenmill.engine.models.qwen2_5_vision import QwenVisionConfig, QwenVisionTower, tower_name
from tokenmill.engine.models.siglip import Gemma3Projector, SiglipVisionTower, VisionConfig
from tokenmill.engine.quant.packed_linear import pack_linear_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Grids (frames, rows, columns of 14 px patches) near 448 x 448 px, mixed aspect ratios;
# a batch of n takes the first n.
QWEN_GRIDS = [(1, 32, 32), (1, 24, 44), (1, 40, 26), (1, 32, 32), (1, 28, 36), (1, 44, 24)]
QWEN_GRIDS += [(1, 36, 28), (1, 26, 40)]


@dataclass
class Case:
    """One tower at one dtype and batch: both systems' calls and their blocks."""

    ours: Callable[[], torch.Tensor]
    theirs: Callable[[], torch.Tensor]
    our_blocks: list[nn.Module]
    their_blocks: list[nn.Module]
    num_images: int


def _randomise(module: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.02 if param.dim() > 1 else 0.3)


def qwen_case(depth: int, dtype: torch.dtype, batch: int, pack: bool) -> Case:
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    shape = dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        out_hidden_size=2048,
    )
    full = (depth - 1,)
    hf_config = Qwen2_5_VLVisionConfig(**shape, fullatt_block_indexes=list(full))
    hf_config._attn_implementation = "sdpa"
    hf = Qwen2_5_VisionTransformerPretrainedModel(hf_config).eval()
    _randomise(hf, 7)
    ours = QwenVisionTower(QwenVisionConfig(**shape, fullatt_block_indexes=full)).eval()
    ours.load_state_dict({tower_name(k): v for k, v in hf.state_dict().items()}, strict=True)
    hf, ours = hf.to(dtype), ours.to(dtype)
    if pack:
        pack_linear_layers(ours, dtype=dtype, device=torch.device("cpu"))
    grids = QWEN_GRIDS[:batch]
    g = torch.Generator().manual_seed(batch)
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)
    patches = patches.to(dtype)
    grid_thw = torch.tensor(grids)
    return Case(
        ours=lambda: ours(patches, grids),
        theirs=lambda: hf(patches, grid_thw=grid_thw).pooler_output,
        our_blocks=list(ours.blocks),
        their_blocks=list(hf.blocks),
        num_images=batch,
    )


def gemma3_case(depth: int, dtype: torch.dtype, batch: int, pack: bool) -> Case:
    from transformers import Gemma3Config, SiglipVisionConfig, SiglipVisionModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    dims = ("hidden_size", "intermediate_size", "num_attention_heads", "image_size", "patch_size")
    shape = {key: GEMMA3_4B_VISION[key] for key in dims} | {"num_hidden_layers": depth}
    hf_vision = SiglipVisionConfig(**shape, vision_use_head=False)
    hf_vision._attn_implementation = "sdpa"
    hf_tower = SiglipVisionModel(hf_vision).eval()
    _randomise(hf_tower, 11)
    text = dict(hidden_size=2560, num_hidden_layers=1, num_attention_heads=8)
    hf_projector = Gemma3MultiModalProjector(
        Gemma3Config(vision_config=hf_vision.to_dict(), text_config=text, mm_tokens_per_image=256)
    ).eval()
    _randomise(hf_projector, 12)
    config = VisionConfig(**shape)
    tower, projector = SiglipVisionTower(config).eval(), Gemma3Projector(config, 2560, 256).eval()
    state = {}
    for name, tensor in hf_tower.state_dict().items():
        state[siglip_tower_name(name.removeprefix("vision_model."))] = tensor
    tower.load_state_dict(state, strict=True)
    projector.load_state_dict(
        {
            "mm_input_projection_weight": hf_projector.mm_input_projection_weight,
            "mm_soft_emb_norm_weight": hf_projector.mm_soft_emb_norm.weight,
        },
        strict=True,
    )
    hf_tower, hf_projector = hf_tower.to(dtype), hf_projector.to(dtype)
    tower, projector = tower.to(dtype), projector.to(dtype)
    if pack:
        pack_linear_layers(tower, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(batch)
    pixels = torch.rand(batch, 3, 896, 896, generator=g).mul(2).sub(1).to(dtype)
    return Case(
        ours=lambda: projector(tower(pixels)),
        theirs=lambda: hf_projector(hf_tower(pixel_values=pixels).last_hidden_state),
        our_blocks=list(tower.layers),
        their_blocks=list(hf_tower.encoder.layers),
        num_images=batch,
    )


CASES = {"qwen2.5-vl": qwen_case, "gemma3": gemma3_case}


class BlockClock:
    """Wall seconds inside a list of blocks, summed over their calls."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.seconds = 0.0
        self._start = 0.0
        for block in blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_) -> None:
        self.seconds += time.perf_counter() - self._start


def timed(call: Callable[[], torch.Tensor], clock: BlockClock) -> tuple[float, float]:
    """(the call's seconds, its seconds inside blocks)."""
    clock.seconds = 0.0
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, clock.seconds


def top_ops(call: Callable[[], torch.Tensor], rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--towers", default="qwen2.5-vl,gemma3")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-profiler", action="store_true")
    parser.add_argument("--no-pack", action="store_true", help="tokenmill on F.linear")
    args = parser.parse_args()

    header = "tower       dtype     imgs  ours s/img  hf s/img  ours/blk  hf/blk  rest ours/hf"
    lines = [header + "  x hf (median, best)"]
    for tower in args.towers.split(","):
        for dtype_name in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                dtype = DTYPES[dtype_name]
                case = CASES[tower](args.depth, dtype, batch, not args.no_pack)
                with torch.inference_mode():
                    got, want = case.ours().float(), case.theirs().float()  # and warm-up
                    error = (got - want).abs().max().item() / want.abs().max().item()
                    if error > (1e-3 if dtype == torch.float32 else 5e-2):
                        raise SystemExit(f"{tower} {dtype_name}: outputs differ ({error:.2e})")
                    ours_clock = BlockClock(case.our_blocks)
                    hf_clock = BlockClock(case.their_blocks)
                    ours, hf = [], []
                    for _ in range(args.rounds):
                        ours.append(timed(case.ours, ours_clock))
                        hf.append(timed(case.theirs, hf_clock))
                    if args.torch_profiler:
                        print(f"--- {tower} {dtype_name} x{batch}: tokenmill")
                        print(top_ops(case.ours))
                        print(f"--- {tower} {dtype_name} x{batch}: transformers")
                        print(top_ops(case.theirs))
                n, depth = case.num_images, args.depth
                ours_s = statistics.median(s for s, _ in ours)
                hf_s = statistics.median(s for s, _ in hf)
                ours_blk = statistics.median(b for _, b in ours) / depth / n
                hf_blk = statistics.median(b for _, b in hf) / depth / n
                ours_rest = statistics.median(s - b for s, b in ours) / n
                hf_rest = statistics.median(s - b for s, b in hf) / n
                ratio = statistics.median(h / o for (o, _), (h, _) in zip(ours, hf))
                best = min(s for s, _ in hf) / min(s for s, _ in ours)
                lines.append(
                    f"{tower:<11} {dtype_name:<9} {n:>4}  {ours_s / n:>10.4f}  {hf_s / n:>8.4f}"
                    f"  {ours_blk:>8.4f}  {hf_blk:>6.4f}  {ours_rest:.4f}/{hf_rest:.4f}"
                    f"  {ratio:.2f}x  {best:.2f}x  (max rel diff {error:.1e})"
                )
                print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
