"""The architecture registry: each model module registers what it implements.

An `Architecture` names the config.json `architectures` entries a model class serves,
parses their config, declares what it does with each config field that can change its
forward pass (`ConfigFields`, config_fields.py), and - when llama.cpp has a layout for
it - says how a GGUF file stores it (`GGUFLayout`). `models/__init__.py` imports every module of the package once,
so a new architecture module is found without an edit anywhere else.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.config_fields import ConfigFields

# llama.cpp's names for a decoder layer's tensors (`blk.N.<name>.weight`) -> the HF
# module path inside `model.layers.N`; an architecture adds or overrides entries.
LLAMA_GGUF_BLOCK_NAMES: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# A mixture-of-experts layer's: llama.cpp's router, and its experts stacked one tensor per
# projection (loader/tensor_plan.py splits each stack into the model's experts).
MOE_GGUF_BLOCK_NAMES: Mapping[str, str] = {
    **LLAMA_GGUF_BLOCK_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Tensors outside the layers: llama.cpp's name -> the HF module path.
GGUF_TOP_LEVEL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp writes an architecture into a GGUF file, and how to read it back.

    extra_config(config, get) -> the config.json fields beyond the ones every GGUF
    architecture shares (`get(key)` reads `<arch>.<key>` from the metadata); the result
    is merged over them.
    """

    gguf_architecture: str  # the file's general.architecture
    hf_architecture: str  # config.json's architectures entry
    model_type: str  # config.json's model_type
    block_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_BLOCK_NAMES)
    # llama.cpp interleaves each q/k head's two rotary halves (its own rope layout).
    permuted_qk: bool = False
    # llama.cpp stores the norm scales as `offset + w` where HF keeps w (Gemma: 1).
    norm_offset: float = 0.0
    # The MLP's activation as config.json spells it: (key, value).
    activation: tuple[str, str] = ("hidden_act", "silu")
    extra_config: Callable[[dict, Callable[..., Any]], dict] | None = None
    # llama.cpp writes some families under another's architecture, told apart by their
    # experts (Mixtral is a `llama` file with `llama.expert_count` set): True for the
    # layout of such a file with experts (gguf_layout).
    experts: bool = False

    def hf_tensor_name(self, gguf_name: str) -> str:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; in a layout
        with expert stacks, llama.cpp's older one tensor per expert too (its converter
        wrote Mixtral so): `blk.3.ffn_gate.5.weight` -> `model.layers.3.mlp.experts.5.
        gate_proj.weight`, which the load stacks into the layer's experts.

        Raises:
            ValueError: a name this layout does not know (dropping a tensor we do not
                understand would give a silently wrong model).
        """
        parts = gguf_name.split(".")
        if len(parts) == 2 and parts[0] in GGUF_TOP_LEVEL_NAMES:
            return f"{GGUF_TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in self.block_names:
            return f"model.layers.{parts[1]}.{self.block_names[parts[2]]}.{parts[3]}"
        stack = self.block_names.get(f"{parts[2]}_exps") if len(parts) == 5 else None
        if parts[0] == "blk" and stack is not None and parts[3].isdigit():
            experts, projection = stack.rsplit(".", 1)
            return f"model.layers.{parts[1]}.{experts}.{int(parts[3])}.{projection}.{parts[4]}"
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")


# What a model can be asked to do (`Architecture.tasks`): generate text (and score
# prompts), or pool its hidden states into an embedding, class probabilities or a
# rerank score (engine/types/pooling_params.py).
GENERATE = "generate"
TASKS = (GENERATE, "embed", "classify", "rerank")


@dataclass(frozen=True)
class Architecture:
    """One model class and the config.json architectures it serves."""

    names: tuple[str, ...]  # config.json `architectures` entries, e.g. "LlamaForCausalLM"
    model_class: type[nn.Module]
    parse_config: Callable[[dict], ModelConfig]  # config.json -> its ModelConfig
    # The config fields it handles, those harmless to it, and those it refuses.
    config_fields: ConfigFields
    # config.json `model_type`s that identify it when `architectures` is missing.
    model_types: tuple[str, ...] = ()
    gguf: GGUFLayout | None = None
    # The TASKS it serves. A causal LM embeds only when its directory says how it pools
    # (sentence-transformers' modules.json): `loader/pooling_config.served_tasks` applies that.
    tasks: tuple[str, ...] = (GENERATE, "embed")

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; tasks are {TASKS}")

    @property
    def is_encoder(self) -> bool:
        """Bidirectional attention and no KV cache (the BERT family): run by the
        encoder runner (`worker/encoder_runner.py`), never by the decode loop."""
        return bool(getattr(self.model_class, "is_encoder", False))


_ARCHITECTURES: dict[str, Architecture] = {}
_BY_MODEL_TYPE: dict[str, Architecture] = {}


def register(architecture: Architecture) -> Architecture:
    """Make an architecture known by each of its names (a model module calls this once)."""
    for name in architecture.names:
        if name in _ARCHITECTURES:
            raise ValueError(f"architecture {name!r} is registered twice")
        _ARCHITECTURES[name] = architecture
    for model_type in architecture.model_types:
        _BY_MODEL_TYPE[model_type] = architecture
    return architecture


def supported_architectures() -> tuple[str, ...]:
    """Every config.json architecture name the engine runs, sorted."""
    return tuple(sorted(_ARCHITECTURES))


def architecture_of(raw: dict) -> Architecture:
    """The registered architecture of a config.json (ValueError naming the supported)."""
    names = raw.get("architectures") or []
    found = _ARCHITECTURES.get(names[0]) if names else None
    if found is None and not names:  # an old config: its model_type, else the Llama family
        found = _BY_MODEL_TYPE.get(raw.get("model_type")) or _ARCHITECTURES["LlamaForCausalLM"]
    if found is None:
        supported = supported_architectures()
        nearest = difflib.get_close_matches(str(names[0]), supported, n=1, cutoff=0.0)
        raise ValueError(
            f"unsupported architecture {names[0]!r} (nearest: {nearest[0]!r}); supported: "
            f"{', '.join(supported)}"
        )
    return found


def gguf_layout(gguf_architecture: str, *, num_experts: int = 0) -> GGUFLayout:
    """The layout of a GGUF file's general.architecture; where two families share it, the
    one whose `experts` says whether the file has them (`num_experts`: its
    `<arch>.expert_count`, 0 when unset). ValueError naming the supported."""
    layouts = {id(a.gguf): a.gguf for a in _ARCHITECTURES.values() if a.gguf}.values()
    named = [layout for layout in layouts if layout.gguf_architecture == gguf_architecture]
    if not named:
        supported = sorted({layout.gguf_architecture for layout in layouts})
        raise ValueError(
            f"unsupported GGUF architecture {gguf_architecture!r}; supported: {supported}"
        )
    if len(named) == 1:
        return named[0]
    return next(layout for layout in named if layout.experts == (num_experts > 0))
