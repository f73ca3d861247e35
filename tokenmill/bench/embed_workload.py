"""Embedding benchmark workloads and the FLOP model of an encoder's roofline.

A workload is texts, not token ids: every system tokenizes for itself, as its users
would call it. Texts are words of the model's own vocabulary (whole-word pieces that
encode to one token each), so a text of n words is about n + 2 tokens with [CLS] and
[SEP]; lengths are drawn log-uniformly between the preset's bounds, so short texts are
common and long ones present - mixed enough that padding matters to a system that pads.

FLOPs of a bidirectional encoder for one text of L computed tokens (multiply-add = 2):

    linear    = 2 * P_layers * L,  P_layers = layers * (4 * hidden^2 + 2 * hidden * ffn)
    attention = 4 * hidden * L^2 * layers   (QK^T and AV, every token sees all L)

The useful work counts each text's tokens after truncation to the model's
max_seq_length and no padding; a system that pads computes more (its "computed /
useful tokens" column).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbedWorkloadSpec:
    name: str
    num_texts: int
    min_tokens: int = 8
    max_tokens: int = 512
    seed: int = 0


EMBED_PRESETS = {
    "embed4k": EmbedWorkloadSpec("embed4k", num_texts=4096),
    # Seconds on any model: for tests and for checking an installation.
    "embed-smoke": EmbedWorkloadSpec("embed-smoke", num_texts=48, max_tokens=96),
}


@dataclass
class EmbedWorkload:
    name: str
    texts: list[str]
    spec: dict

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, path: str | Path) -> EmbedWorkload:
        return cls(**json.loads(Path(path).read_text()))


def build_embed_workload(spec: EmbedWorkloadSpec, tokenizer_json: str | Path) -> EmbedWorkload:
    """The texts of `spec` drawn from a tokenizer's whole-word vocabulary (seeded)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab()
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and len(w) > 2)
    if not words:  # a byte-level BPE: its word pieces start with "Ġ"
        words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha())
    rng = random.Random(f"{spec.seed}:texts")
    low, high = math.log(spec.min_tokens), math.log(spec.max_tokens)
    texts = []
    for _ in range(spec.num_texts):
        num_words = max(1, int(math.exp(rng.uniform(low, high))) - 2)
        texts.append(" ".join(rng.choice(words) for _ in range(num_words)))
    return EmbedWorkload(spec.name, texts, asdict(spec))


@dataclass(frozen=True)
class EncoderShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> EncoderShape:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"])

    @property
    def layer_matmul_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + 2 * h * i)

    def flops(self, lengths: list[int]) -> int:
        """Useful FLOPs of texts of `lengths` computed tokens each (no padding)."""
        linear = 2 * self.layer_matmul_params * sum(lengths)
        attention = 4 * self.hidden_size * self.num_layers * sum(n * n for n in lengths)
        return linear + attention

    def matmul_shapes(self, num_tokens: int) -> list[tuple[int, int, int]]:
        """(m, k, n) of a batch's matmuls: qkv, attention output, FFN in and out."""
        h, i = self.hidden_size, self.intermediate_size
        return [(num_tokens, h, 3 * h), (num_tokens, h, h), (num_tokens, h, i), (num_tokens, i, h)]
