"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder with

- q, k and v stored as one projection (`qkv_proj`) and gate and up as one (`gate_up_proj`,
  gate first) - the fused layout the engine's layers compute in, so they load as they are;
- rotary on the leading `partial_rotary_factor` share of each head (Phi-4-mini: 0.75);
- LongRoPE: short factors up to `original_max_position_embeddings`, long ones past it,
  chosen per sequence (rope.py);
- a sliding window on every layer where `sliding_window` is set (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.llama import LlamaForCausalLM, decoder_config
from tokenmill.engine.models.registry import Architecture, register


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's projections are already fused as ours are.
    packed_modules: dict[str, tuple[str, int]] = {}


def _rope(raw: dict) -> tuple[dict | None, float]:
    """(rope_scaling, partial_rotary_factor) as transformers' Phi3Config reads them: the
    old "su" and "yarn" names of its scaling are LongRoPE, and the original context is
    always the top-level field (4096 when absent)."""
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    rope.pop("partial_rotary_factor", None)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("su", "yarn"):
        kind = "longrope"
    if kind not in ("default", "longrope"):
        raise ValueError(
            f"Phi3ForCausalLM: rope_scaling type {kind!r} is not one transformers' Phi-3 "
            "runs (default or longrope)"
        )
    rope.pop("type", None)
    if kind == "longrope":
        rope["rope_type"] = kind
        rope["original_max_position_embeddings"] = raw.get("original_max_position_embeddings", 4096)
    return rope or None, float(partial)


def parse_config(raw: dict) -> ModelConfig:
    rope, partial = _rope(raw)
    rope_theta = raw.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
    plain = {**raw, "rope_scaling": None, "rope_parameters": rope, "rope_theta": rope_theta}
    config = decoder_config(
        plain,
        max_position_embeddings=4096,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        partial_rotary_factor=partial,
        sliding_window=raw.get("sliding_window"),
        attention_bias=False,
        attention_output_bias=False,
        mlp_bias=False,
    )
    if int(config.head_dim * partial) % 2:
        raise ValueError(
            f"Phi3ForCausalLM: partial_rotary_factor {partial} leaves an odd rotary "
            f"dimension of head_dim {config.head_dim}"
        )
    return config


# transformers' Phi3Config, field by field.
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED
    | {"partial_rotary_factor", "original_max_position_embeddings", "sliding_window"},
    harmless={
        **DECODER_HARMLESS,
        "resid_pdrop": "dropout is off at inference",
        "embd_pdrop": "dropout is off at inference",
    },
)

register(
    Architecture(
        names=("Phi3ForCausalLM",),
        model_class=Phi3ForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("phi3",),
    )
)
