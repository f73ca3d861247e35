"""`ModelConfig`: the shape every decoder architecture shares, read from an HF config.json.

An architecture whose models need more (Gemma 3's local rope base, say) subclasses it in
its own module; `common_fields` parses the keys every family spells the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING_ATTENTION = "sliding_attention"  # a `layer_types` entry: the layer sees a window


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
    qk_norm: bool = False  # q and k RMS-normalised per head before rotary
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}
    # Sliding-window attention: a query at position p sees keys p - window + 1 .. p. Every
    # layer has it unless `layer_types` names the ones that do.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" | "full_attention"
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def max_context(self) -> int:
        """The longest sequence this implementation computes exactly: the model's own
        limit (attention honours sliding windows on every path)."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx`; None for a layer that sees everything."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None


def common_fields(raw: dict, **overrides: Any) -> dict[str, Any]:
    """ModelConfig's fields from the config.json keys the Llama family shares; an
    architecture passes what it spells or defaults differently as `overrides`.

    transformers 5 moved rope settings into `rope_parameters`; older files keep
    `rope_theta` and `rope_scaling` at the top level. Both are read.
    """
    num_heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = raw.get("rope_theta", rope.pop("rope_theta", 10000.0))
    fields = {
        "architecture": (raw.get("architectures") or ["LlamaForCausalLM"])[0],
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": raw.get("num_key_value_heads") or num_heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // num_heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope_theta),
        "max_position_embeddings": raw.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "rope_scaling": rope_scaling_of(raw.get("rope_scaling") or (rope or None)),
        "sliding_window": sliding_window_of(raw),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": token_ids_of(raw.get("eos_token_id")),
    }
    return {**fields, **overrides}


def rope_scaling_of(scaling: dict | None) -> dict | None:
    """An HF rope_scaling dict with its kind under "rope_type"; None for plain rope."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else {**scaling, "rope_type": kind}


def sliding_window_of(raw: dict) -> int | None:
    # Qwen2 configs carry a window but switch it off with use_sliding_window.
    if raw.get("use_sliding_window") is False:
        return None
    return raw.get("sliding_window") or None


def token_ids_of(value: int | list[int] | None) -> list[int]:
    """config.json's eos_token_id (one id, a list, or absent) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
