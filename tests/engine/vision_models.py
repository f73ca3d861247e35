"""A random-weight Gemma 3 vision-language checkpoint built in the test (tiny SigLIP
tower, tiny text model), and transformers as its reference."""

from __future__ import annotations

import io
import json
import weakref
from pathlib import Path

import torch
from hf_models import GEMMA3, SMALL

# Token ids of the tiny model's image markers (inside its 256-token vocabulary).
BOI, EOI, IMAGE = 250, 251, 252
# A 32 px tower of 4 px patches (8 x 8 = 64 patches) pooled 2 x 2 into 16 soft tokens.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=4,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    vision_use_head=False,
)
TOKENS_PER_IMAGE = 16


def build_gemma3_vlm(out_dir: Path, **text_overrides):
    """Save a random-weight Gemma3ForConditionalGeneration (std ~0.05 everywhere, norms
    included) and its preprocessor_config.json; return the HF model."""
    import transformers

    text = {**SMALL, **GEMMA3, **text_overrides}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )
    torch.manual_seed(4321)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                param.normal_(0, 0.05 if param.dim() > 1 else 0.3)
            elif name.endswith("norm.weight"):
                param.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor().save_pretrained(out_dir)
    return model


def image_processor(size: int = 32):
    """transformers' default Gemma 3 image processor here: torchvision is not installed,
    so AutoImageProcessor falls back to the PIL backend, `Gemma3ImageProcessorPil`."""
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": size, "width": size})


def png_bytes(width: int, height: int, seed: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A random-noise image, encoded."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    if mode == "I;16":  # 16-bit grey
        pixels = torch.randint(0, 65536, (height, width), generator=g, dtype=torch.int32)
        image = Image.fromarray(pixels.numpy().astype("uint16"))
    else:
        channels = {"RGB": 3, "RGBA": 4, "L": 1, "CMYK": 4, "P": 3}[mode]
        pixels = torch.randint(0, 256, (height, width, channels), generator=g, dtype=torch.uint8)
        array = pixels.numpy() if channels > 1 else pixels[..., 0].numpy()
        image = Image.fromarray(array, mode="RGB" if mode == "P" else mode)
        if mode == "P":  # a palette image
            image = image.quantize(colors=64)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


MARKERS = {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE}


# Gemma 3's chat template's shape: a turn per message, an image part as the marker.
GEMMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_chat_marker_tokenizer(out_dir: Path) -> None:
    """save_marker_tokenizer, with GEMMA3_CHAT_TEMPLATE as its chat template."""
    save_marker_tokenizer(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = GEMMA3_CHAT_TEMPLATE
    path.write_text(json.dumps(config))


def save_marker_tokenizer(out_dir: Path, vocab_size: int = 256):
    """A character tokenizer (letters, digits, space, newline) whose image markers are
    special tokens at the model's ids; saved to out_dir, and returned as transformers'
    Gemma3Processor over it and the PIL image processor - the reference for token counts."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import Gemma3Processor, PreTrainedTokenizerFast

    # Capitals too: pan-and-scan's text around an image's crops starts "Here is".
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789 \n.,")
    chars += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update(
        {f"<unused{i}>": i for i in range(len(chars), vocab_size) if i not in MARKERS.values()}
    )
    vocab.update(MARKERS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True) for t in MARKERS])
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    return Gemma3Processor(
        image_processor=image_processor(), tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE
    )


class DecodedPixels:
    """Counts the decoded images alive at once: every image's pixels pass through
    `ImageProcessor.resize`, which this wraps (through monkeypatch) to keep a weak
    reference to each result."""

    def __init__(self, monkeypatch) -> None:
        from tokenmill.engine.loader.images import ImageProcessor

        self.alive: list[weakref.ref] = []
        self.most = 0
        resize = ImageProcessor.resize

        def counting_resize(processor, image):
            pixels = resize(processor, image)
            self.alive.append(weakref.ref(pixels))
            self.most = max(self.most, sum(ref() is not None for ref in self.alive))
            return pixels

        monkeypatch.setattr(ImageProcessor, "resize", counting_resize)
