"""`ModelConfig`: the shape every decoder architecture shares, read from an HF config.json.

An architecture whose models need more (Gemma 3's local rope base, say) subclasses it in
its own module; `common_fields` parses the keys every family spells the same way.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.models.rope import Rope, longrope_attention_factor, yarn_attention_factor

SLIDING_ATTENTION = "sliding_attention"  # a `layer_types` entry: the layer sees a window
FULL_ATTENTION = "full_attention"  # a `layer_types` entry: the layer sees every position

# Rotary scalings the rotary tables compute (rope.py), each with the keys of its
# rope_scaling dict it reads; "default" is plain rope.
ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {
            "short_factor",
            "long_factor",
            "factor",
            "attention_factor",
            "original_max_position_embeddings",
        }
    ),
}
# Keys each scaling cannot go without (transformers fails without them too).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
# Keys of a rope dict that name it or its base rather than scale it; and keys other
# scalings read that change nothing at these values.
_ROPE_NAMING_KEYS = frozenset({"rope_type", "type", "rope_theta"})
_ROPE_NEUTRAL = {
    "partial_rotary_factor": (1, 1.0),
    "attention_factor": (1, 1.0),
    "factor": (1, 1.0),
}


@dataclass
class ModelConfig:
    """The subset of an HF config.json the engine's decoders need."""

    architecture: str  # config.json's architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q, k and v projections
    attention_output_bias: bool = False  # a bias on the attention's output projection
    mlp_bias: bool = False  # biases on the gated MLP's gate, up and down projections
    qk_norm: bool = False  # q and k RMS-normalised per head before rotary
    rope_scaling: dict | None = None  # config.rope_scaling_of: {"rope_type": ..., ...}
    # The share of each head's dimensions that rotate (Phi-3, Phi-4-mini: the leading ones).
    partial_rotary_factor: float = 1.0
    # Sliding-window attention: a query at position p sees keys p - window + 1 .. p. Every
    # layer has it unless `layer_types` names the ones that do.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" | "full_attention"
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    # A learned logit per query head in each attention softmax's denominator (gpt-oss).
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION})
            if unknown:
                raise ValueError(
                    f"layer_types has {unknown}: only {SLIDING_ATTENTION!r} and "
                    f"{FULL_ATTENTION!r} layers are implemented"
                )

    @property
    def max_context(self) -> int:
        """The longest sequence this implementation computes exactly: the model's own
        limit (attention honours sliding windows on every path) - extended by the rope
        scalings whose purpose that is, as vLLM reads them: dynamic by its factor, yarn
        to its factor times the original context."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type")
        if kind == "dynamic":
            return int(self.max_position_embeddings * scaling["factor"])
        if kind == "yarn":
            extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
            return max(self.max_position_embeddings, extended)
        return self.max_position_embeddings

    @property
    def rope(self) -> Rope:
        """The rotary embedding of the layers (rope.py)."""
        dim = int(self.head_dim * self.partial_rotary_factor)
        return Rope(dim, self.rope_theta, self.rope_scaling)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx`; None for a layer that sees everything."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None


def common_fields(raw: dict, **overrides: Any) -> dict[str, Any]:
    """ModelConfig's fields from the config.json keys the Llama family shares; an
    architecture passes what it spells or defaults differently as `overrides` (its
    transformers class's defaults: `max_position_embeddings`, `head_dim`, ...).

    transformers 5 moved rope settings into `rope_parameters`; older files keep
    `rope_theta` and `rope_scaling` at the top level. Both are read. `attention_bias`
    puts biases on q, k, v and the output projection, as transformers' Llama does.
    Sliding windows are each architecture's own (none here).
    """
    num_heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = raw.get("rope_theta", rope.pop("rope_theta", 10000.0))
    max_positions = overrides.pop("max_position_embeddings", 4096)
    max_positions = raw.get("max_position_embeddings") or max_positions
    head_dim = overrides.pop("head_dim", None)
    attention_bias = bool(raw.get("attention_bias", False))
    fields = {
        "architecture": (raw.get("architectures") or ["LlamaForCausalLM"])[0],
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": raw.get("num_key_value_heads") or num_heads,
        "head_dim": raw.get("head_dim") or head_dim or raw["hidden_size"] // num_heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope_theta),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": attention_bias,
        "attention_output_bias": attention_bias,
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "rope_scaling": rope_scaling_of(raw.get("rope_scaling") or (rope or None), max_positions),
        "hidden_act": raw.get("hidden_act", "silu"),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": token_ids_of(raw.get("eos_token_id")),
    }
    return {**fields, **overrides}


def rope_scaling_of(scaling: dict | None, max_position_embeddings: int) -> dict | None:
    """An HF rope_scaling dict with its kind under "rope_type" and the defaults
    transformers fills in resolved; None for plain rope.

    Resolved: the original context of llama3, yarn, longrope (the model's, where the dict
    has none) and dynamic (always the model's, as transformers reads it); yarn's and
    longrope's factor (where None: the model's context over the original) and their
    attention factors.

    Raises:
        ValueError: a scaling the rotary tables do not compute, a key of it they do not
            read, or one it needs missing (naming it): a model must never run with its
            rope unscaled.
    """
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        supported = [k for k in ROPE_TYPES if k != "default"]
        nearest = difflib.get_close_matches(str(kind), supported, n=1, cutoff=0.0)
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (nearest: {nearest[0]!r}; "
            f"supported: {', '.join(supported)}, or none)"
        )
    for key, value in scaling.items():
        if key in ROPE_TYPES[kind] or key in _ROPE_NAMING_KEYS:
            continue
        if value is None or value in _ROPE_NEUTRAL.get(key, ()):
            continue
        raise ValueError(f"rope_scaling {key!r} (= {value!r}) is not supported for {kind!r} rope")
    missing = [k for k in _ROPE_REQUIRED.get(kind, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{kind!r} rope_scaling needs {', '.join(missing)}")
    if kind == "default":
        return None
    scaling = {k: v for k, v in scaling.items() if k in ROPE_TYPES[kind] and v is not None}
    if kind == "dynamic":  # transformers' dynamic rope grows past the model's own context
        scaling["original_max_position_embeddings"] = max_position_embeddings
    else:  # transformers 5 defaults the original context to the model's
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    original = scaling["original_max_position_embeddings"]
    if kind in ("yarn", "longrope"):
        scaling.setdefault("factor", max_position_embeddings / original)
    if kind == "yarn" and "attention_factor" not in scaling:
        scaling["attention_factor"] = yarn_attention_factor(
            scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        )
    if kind == "longrope" and "attention_factor" not in scaling:
        scaling["attention_factor"] = longrope_attention_factor(scaling["factor"], original)
    return {**scaling, "rope_type": kind}


def sliding_layers(raw: dict, num_layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of a Qwen2/Qwen3 config, as transformers reads it:
    the window only with `use_sliding_window`, and then - unless `layer_types` says
    which layers slide - only the layers from `max_window_layers` on."""
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if window is None:
        return None, layer_types
    if layer_types is None:
        first = raw.get("max_window_layers", 28)
        layer_types = [
            SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)
        ]
    return window, list(layer_types)


def token_ids_of(value: int | list[int] | None) -> list[int]:
    """config.json's eos_token_id (one id, a list, or absent) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
