"""A tiny random-weight vision-language model directory, for checking the image bench and
the image-job scripts where no real VLM is on the machine (none can be fetched offline).

    python -m tokenmill.bench.tiny_vlm qwen2.5-vl|gemma3|gemma3-4b-tower OUT_DIR

transformers builds the model from a config and saves it as a Hub repository is laid out
(config.json, model.safetensors, preprocessor_config.json), with a character tokenizer
whose image markers are special tokens. Its figures are the pipeline's, not a real
model's: the tower is a few thousand parameters - except `gemma3-4b-tower`, Gemma 3 4B's
own SigLIP tower (So400m: 27 layers of width 1,152, 896 px in 14 px patches, 256 soft
tokens an image, about 5 TFLOP an image) and projector, random, before the small text
model: the tower's speed at its real size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 256
# The marker tokens' ids, inside the vocabulary: (start, image, end).
MARKER_IDS = (250, 252, 251)
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
KINDS = ("qwen2.5-vl", "gemma3", "gemma3-4b-tower")
# What every Gemma 3 SigLIP tower's vision_config sets alike.
SIGLIP_COMMON = dict(layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_use_head=False)
# Gemma 3 4B's vision_config (SigLIP So400m at 896 px) and soft tokens an image.
GEMMA3_4B_VISION = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=896,
    patch_size=14,
    **SIGLIP_COMMON,
)
GEMMA3_4B_TOKENS = 256


def build_tiny_vlm(kind: str, out_dir: str | Path) -> Path:
    """Save a random-weight VLM of `kind` (one of KINDS) into out_dir; return it."""
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown tiny VLM {kind!r}; choose from {', '.join(KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start, image, end = MARKER_IDS
    torch.manual_seed(1234)
    if kind == "qwen2.5-vl":
        # 4 px patches merged 2 x 2 (a token is 8 x 8 px), windows of 16 px, one block
        # of full attention; images scaled to 64..4096 tokens' worth of pixels.
        vision = dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=16,
            out_hidden_size=TEXT["hidden_size"],
            fullatt_block_indexes=[1],
        )
        text = {
            **TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        }
        config = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=image,
            vision_start_token_id=start,
            vision_end_token_id=end,
            video_token_id=253,
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        processor = transformers.Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=96 * 96
        )
        markers = {"<|vision_start|>": start, "<|image_pad|>": image, "<|vision_end|>": end}
    else:
        # A 32 px SigLIP tower of 4 px patches, pooled 2 x 2 into 16 soft tokens (or
        # Gemma 3 4B's own).
        real_tower = kind == "gemma3-4b-tower"
        vision = (
            GEMMA3_4B_VISION
            if real_tower
            else dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=32,
                patch_size=4,
                **SIGLIP_COMMON,
            )
        )
        text = {
            **TEXT,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.1,
        }
        size = vision["image_size"]
        config = transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=GEMMA3_4B_TOKENS if real_tower else 16,
            boi_token_index=start,
            eoi_token_index=end,
            image_token_index=image,
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
        processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
        markers = {"<start_of_image>": start, "<image_soft_token>": image, "<end_of_image>": end}
    with torch.no_grad():  # weights larger than the default, so greedy tokens are no ties
        for name, param in model.named_parameters():
            if any(part in name for part in ("visual", "vision_tower", "multi_modal_projector")):
                param.normal_(0, 0.05 if param.dim() > 1 else 0.3)
    model.eval().save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    _save_tokenizer(out, markers)
    return out


def _save_tokenizer(out: Path, markers: dict[str, int]) -> None:
    """Lower-case letters, digits and a few signs, one token each; the image markers
    special tokens at their ids; every other id an unused placeholder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789 \n.,")
    vocab = {c: i for i, c in enumerate(chars)}
    taken = set(markers.values())
    vocab |= {f"<unused{i}>": i for i in range(len(chars), VOCAB) if i not in taken}
    vocab |= markers
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in markers])
    backend.save(str(out / "tokenizer.json"))
    config = {
        "eos_token": None,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(build_tiny_vlm(sys.argv[1], sys.argv[2]))
