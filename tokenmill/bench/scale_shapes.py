"""Published model shapes the bench builds random-weight models at, and the tensors each
checkpoint holds.

The configs are the published `config.json` numbers of each model (vocabulary sizes
included: a small vocabulary flatters decode, whose lm_head reads every row). Only the
token ids differ: the built models carry the embedded default model's tokenizer
(SmolLM2's), whose ids all lie below every vocabulary here but Mixtral's 32,000 (built
only with vocab_size overridden to 49,152 or more), so bos/eos come from it.

`checkpoint_tensors` lists every tensor of the checkpoint as transformers saves it (HF
names, [out, in] weights, one tensor per expert) - the one place the builder, the GGUF
writer and the tests learn the layout from.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}

# name -> the published config.json (bos/eos left out: the tokenizer's are used).
SHAPES: dict[str, dict] = {
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "max_window_layers": 21,
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
}
SHAPE_NAMES = tuple(SHAPES)
# The file a built scale model's directory holds (shape, seed, build version).
SCALE_RECORD = "tokenmill_scale_model.json"
# The llama.cpp formats scale_gguf.py writes a scale model in.
GGUF_FORMATS = ("F32", "BF16", "Q8_0", "Q4_0")
# The dimensions a test may shrink (with the layer count) to build a shape in milliseconds.
SHRINKABLE = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",  # Mixtral's num_experts
    "num_experts_per_tok",
    "vocab_size",
)


def shape_config(
    name: str, *, num_layers: int | None = None, overrides: dict | None = None
) -> dict:
    """The published config of `name`, with fewer layers or shrunk dimensions if asked.

    Raises:
        ValueError: an unknown shape, a layer count outside 1..published, or an override
            of a field that is not a dimension (SHRINKABLE) or not in the config.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPE_NAMES)}")
    config = copy.deepcopy(SHAPES[name])
    published = config["num_hidden_layers"]
    if num_layers is not None:
        if not 1 <= num_layers <= published:
            raise ValueError(f"{name} has {published} layers: num_layers must be 1..{published}")
        config["num_hidden_layers"] = num_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    for key, value in (overrides or {}).items():
        if key not in SHRINKABLE:
            raise ValueError(f"{key!r} cannot be overridden; only {', '.join(SHRINKABLE)}")
        if key not in config:  # a field the model does not have would change nothing
            raise ValueError(f"{name} has no {key!r} to override")
        config[key] = value
    return config


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name, shape, and how its random values are drawn."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std INIT_STD), "ones" (a norm's scale)


INIT_STD = 0.02  # transformers' initializer_range for every model here


def checkpoint_tensors(config: dict) -> list[TensorSpec]:
    """Every tensor of a checkpoint of `config`, in transformers' names and layout.

    Raises:
        ValueError: a model_type this list does not know.
    """
    model_type = config["model_type"]
    if model_type not in ("llama", "qwen2", "olmoe", "qwen3_moe", "mixtral"):
        raise ValueError(f"no checkpoint layout for model_type {model_type!r}")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    num_heads, num_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    q_dim, kv_dim = num_heads * head_dim, num_kv * head_dim
    tensors = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            TensorSpec(p + "input_layernorm.weight", (hidden,), "ones"),
            TensorSpec(p + "self_attn.q_proj.weight", (q_dim, hidden), "normal"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_dim, hidden), "normal"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_dim, hidden), "normal"),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, q_dim), "normal"),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "ones"),
        ]
        if model_type == "qwen2":  # q, k, v biases are part of the architecture
            tensors += [
                TensorSpec(p + f"self_attn.{x}_proj.bias", (dim,), "normal")
                for x, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))
            ]
        if model_type == "olmoe":  # q/k norms over all heads at once
            tensors += [
                TensorSpec(p + "self_attn.q_norm.weight", (q_dim,), "ones"),
                TensorSpec(p + "self_attn.k_norm.weight", (kv_dim,), "ones"),
            ]
        if model_type == "qwen3_moe":  # q/k norms per head
            tensors += [
                TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), "ones"),
                TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), "ones"),
            ]
        tensors += _mlp_tensors(config, i, p + "mlp.")
    tensors.append(TensorSpec("model.norm.weight", (hidden,), "ones"))
    if not config["tie_word_embeddings"]:
        tensors.append(TensorSpec("lm_head.weight", (vocab, hidden), "normal"))
    return tensors


def _mlp_tensors(config: dict, layer: int, prefix: str) -> list[TensorSpec]:
    """A layer's MLP: dense gate/up/down, or a router and one gate/up/down per expert."""
    hidden = config["hidden_size"]
    if config["model_type"] == "mixtral":  # its own names: w1 (gate), w3 (up), w2 (down)
        inter, moe = config["intermediate_size"], prefix.replace(".mlp.", ".block_sparse_moe.")
        tensors = [TensorSpec(moe + "gate.weight", (config["num_local_experts"], hidden), "normal")]
        for e in range(config["num_local_experts"]):
            tensors += [
                TensorSpec(f"{moe}experts.{e}.w1.weight", (inter, hidden), "normal"),
                TensorSpec(f"{moe}experts.{e}.w3.weight", (inter, hidden), "normal"),
                TensorSpec(f"{moe}experts.{e}.w2.weight", (hidden, inter), "normal"),
            ]
        return tensors
    if _is_sparse(config, layer):
        # OLMoE's experts are intermediate_size wide; Qwen3-MoE's have a size of their own.
        inter = config.get("moe_intermediate_size", config["intermediate_size"])
        tensors = [TensorSpec(prefix + "gate.weight", (config["num_experts"], hidden), "normal")]
        for e in range(config["num_experts"]):
            tensors += _swiglu(f"{prefix}experts.{e}.", hidden, inter)
        return tensors
    return _swiglu(prefix, hidden, config["intermediate_size"])


def _swiglu(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [
        TensorSpec(prefix + "gate_proj.weight", (inter, hidden), "normal"),
        TensorSpec(prefix + "up_proj.weight", (inter, hidden), "normal"),
        TensorSpec(prefix + "down_proj.weight", (hidden, inter), "normal"),
    ]


def _is_sparse(config: dict, layer: int) -> bool:
    """Whether `layer` is a mixture of experts (transformers' rule for each family)."""
    if config["model_type"] == "olmoe":
        return True
    if config["model_type"] == "qwen3_moe":
        step = config.get("decoder_sparse_step", 1)
        return layer not in config.get("mlp_only_layers", []) and (layer + 1) % step == 0
    return False


def num_parameters(config: dict) -> int:
    """Parameters of a checkpoint of `config` (tied embeddings once)."""
    total = 0
    for spec in checkpoint_tensors(config):
        count = 1
        for dim in spec.shape:
            count *= dim
        total += count
    return total


def is_scale_model(model_dir: str | os.PathLike) -> bool:
    """Whether build_scale_model made this directory."""
    return (Path(model_dir) / SCALE_RECORD).is_file()
