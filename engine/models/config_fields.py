"""What each architecture does with the config.json fields that can change a forward pass.

Every architecture module declares a `ConfigFields`: the fields it reads and honours
(`handled`), those that cannot change its answers (`harmless`, each with why), and those
it does not implement (`refused`, each with why and the values that switch it off). The
registry checks a config.json against it before anything else is read
(`models.parse_config`): a refused field set to a value that changes the forward pass
is refused by name - never run wrong. The table is the module's promise; the tests hold
it to transformers' config class of the architecture (every field declared) and set
each refused field to prove the refusal names it.

Fields of other transformers families that change their forward passes
(`FOREIGN_FIELDS`: soft-capping, partial rotary, qk norms, MoE sizes, ...) are refused
for every architecture that does not declare them itself: a checkpoint whose config
sets one was trained with it, whatever its `architectures` entry says. Any other key
is not read by transformers' class for the architecture either, and is ignored.

`quantization_config` is the quantization layer's (quant/checkpoint_formats.py), which
refuses every checkpoint format before a weight is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.models.config import FULL_ATTENTION


@dataclass(frozen=True)
class Refused:
    """A field the architecture does not implement.

    `is_off(value, raw)` says whether a value (in the whole config.json `raw`) leaves
    the forward pass as the architecture computes it; any other value is refused.
    """

    why: str
    is_off: Callable[[Any, dict], bool]


def off_at(*values: Any) -> Callable[[Any, dict], bool]:
    """An `is_off` for a field that changes nothing at these values (absent: None)."""

    def is_off(value: Any, raw: dict) -> bool:
        return any(value == off and type(value) is type(off) for off in values) or value is None

    return is_off


def refused(why: str, *off: Any) -> Refused:
    """A Refused field that is off at `off` (and None)."""
    return Refused(why, off_at(*off))


def _all_full_attention(value: Any, raw: dict) -> bool:
    return value is None or all(kind == FULL_ATTENTION for kind in value)


def _no_rope_scaling(value: Any, raw: dict) -> bool:
    if not value:
        return True
    if not isinstance(value, dict):
        return False
    kind = value.get("rope_type", value.get("type", "default"))
    return kind == "default" and set(value) <= {"rope_type", "type", "rope_theta"}


@dataclass(frozen=True)
class ConfigFields:
    """One architecture's declaration (see the module docstring)."""

    handled: frozenset[str]
    harmless: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, Refused] = field(default_factory=dict)

    def __post_init__(self) -> None:
        twice = (self.handled & set(self.harmless)) | (
            (self.handled | set(self.harmless)) & set(self.refused)
        )
        if twice:
            raise ValueError(f"config fields declared twice: {sorted(twice)}")

    @property
    def declared(self) -> frozenset[str]:
        """Every field decided about for this architecture: its own and the base ones."""
        return self.handled | set(self.harmless) | set(self.refused) | set(BASE_FIELDS)

    def refusals(self) -> dict[str, Refused]:
        """The fields refused for this architecture: its own, and those of other families
        it does not declare."""
        own = self.handled | set(self.harmless) | set(BASE_FIELDS)
        foreign = {k: v for k, v in FOREIGN_FIELDS.items() if k not in own}
        return {**foreign, **self.refused}

    def check(self, raw: dict, architecture: str) -> None:
        """Raise ValueError naming the first field of `raw` set to a value that changes a
        forward pass this architecture does not compute."""
        for key, rule in self.refusals().items():
            if key in raw and not rule.is_off(raw[key], raw):
                raise ValueError(
                    f"{architecture}: config.json sets {key} = {raw[key]!r}, which tokenmill "
                    f"does not implement for this architecture ({rule.why}); refusing "
                    "rather than computing a different model"
                )


def declare(
    handled: Iterable[str],
    harmless: Mapping[str, str] | None = None,
    refused: Mapping[str, Refused] | None = None,
) -> ConfigFields:
    """A ConfigFields from plain collections."""
    return ConfigFields(frozenset(handled), dict(harmless or {}), dict(refused or {}))


# transformers' PreTrainedConfig fields, shared by every architecture: none changes the
# forward pass of a model tokenmill runs (or it is read where it matters: id2label).
BASE_FIELDS: Mapping[str, str] = {
    "architectures": "read by the registry to pick the architecture",
    "transformers_version": "provenance",
    "_name_or_path": "provenance: where transformers loaded the config from",
    "dtype": "the checkpoint's storage dtype; the engine's dtype is its own setting",
    "torch_dtype": "the checkpoint's storage dtype (older name of dtype)",
    "model_type": "read by the registry when architectures is missing",
    "id2label": "the classification head's labels (read by the heads that have one)",
    "label2id": "the inverse of id2label",
    "problem_type": "the training loss of a classification head",
    "return_dict": "the Python return type of transformers' forward",
    "output_hidden_states": "what transformers' forward returns, not what it computes",
    "output_attentions": "what transformers' forward returns, not what it computes",
    "chunk_size_feed_forward": "the feed-forward computed in chunks: the same values",
    "is_encoder_decoder": "no registered architecture has an encoder-decoder form",
    "quantization_config": "refused by the quantization layer (quant/checkpoint_formats.py)",
    "compression_config": "compressed-tensors' older name of quantization_config (same)",
}

# Fields every decoder family's transformers class defines that cannot change its answers.
DECODER_HARMLESS: Mapping[str, str] = {
    "initializer_range": "initialises weights for training; the checkpoint replaces them",
    "use_cache": "transformers' own KV cache; tokenmill keeps its paged one",
    "attention_dropout": "dropout is off at inference",
    "pad_token_id": "a tokenizer id; padding never reaches the forward pass here",
    "is_decoder": "a decoder-only model attends causally whatever it says",
    "add_cross_attention": "transformers' decoder-only classes have no cross-attention",
}

# The Llama family's shape and rotary fields, read by config.common_fields.
LLAMA_FAMILY_HANDLED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
    }
)

# Fields of other transformers families that change their forward passes, refused
# wherever an architecture does not declare them.
FOREIGN_FIELDS: Mapping[str, Refused] = {
    "attention_bias": refused("biases on the attention projections", False),
    "mlp_bias": refused("biases on the MLP projections", False),
    "use_sliding_window": refused("sliding-window attention", False),
    "sliding_window": refused("sliding-window attention"),
    "layer_types": Refused("per-layer attention kinds", _all_full_attention),
    "rope_scaling": Refused("rotary position embeddings", _no_rope_scaling),
    "rope_parameters": Refused("rotary position embeddings", _no_rope_scaling),
    "partial_rotary_factor": refused("rotary embedding on part of each head", 1.0, 1),
    "attn_logit_softcapping": refused("attention logits soft-capped (Gemma 2)"),
    "final_logit_softcapping": refused("output logits soft-capped"),
    "query_pre_attn_scalar": refused("queries scaled by their own scalar (Gemma)"),
    "use_bidirectional_attention": refused("bidirectional attention in a decoder", False),
    "use_qk_norm": refused("q and k RMS-normalised per head", False),
    "qk_layernorm": refused("q and k layer-normalised", False),
    "clip_qkv": refused("q, k and v clipped (OLMo)"),
    "logits_scaling": refused("output logits divided by a scale (Granite)", 1.0, 1),
    "embedding_multiplier": refused("embeddings multiplied by a scale (Granite)", 1.0, 1),
    "residual_multiplier": refused("residual branches scaled (Granite)", 1.0, 1),
    "attention_multiplier": refused("attention scaled by its own factor (Granite)"),
    "num_experts": refused("a mixture of experts", 0, 1),
    "num_local_experts": refused("a mixture of experts", 0, 1),
    "n_routed_experts": refused("a mixture of experts", 0, 1),
    "moe_intermediate_size": refused("a mixture of experts", 0),
}
