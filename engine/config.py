"""Configuration dataclasses: the model's shape (from config.json) and the engine's knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Architectures we implement, by the `architectures[0]` name in config.json.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)

SLIDING_ATTENTION = "sliding_attention"  # a `layer_types` entry: the layer sees a window


@dataclass
class ModelConfig:
    """The subset of an HF config.json that the Llama-family models need."""

    architecture: str
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
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head
    rope_scaling: dict | None = None
    # Sliding-window attention: a query at position p sees keys p - window + 1 .. p. Every
    # layer has it (Mistral) unless `layer_types` names the ones that do (Gemma 3).
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" | "full_attention"
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    # Gemma 3: local (sliding) layers rotate with their own base; queries are scaled by
    # query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; logits may be soft-capped.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture == "Gemma3ForCausalLM" or raw.get("model_type") == "gemma3_text":
            return cls._from_gemma3_dict(raw)
        num_heads = raw["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; older files keep
        # `rope_theta` and `rope_scaling` at the top level.
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = raw.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or (rope or None)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else {**rope_scaling, "rope_type": kind}
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", is_qwen2)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_scaling=rope_scaling,
            sliding_window=_sliding_window(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def _from_gemma3_dict(cls, raw: dict) -> ModelConfig:
        """Gemma 3 text configs: transformers 5 nests the rope bases by layer type in
        `rope_parameters`; older files keep `rope_theta` and `rope_local_base_freq`."""
        num_layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is None:  # transformers' default: every 6th layer is global
            pattern = raw.get("sliding_window_pattern", 6)
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        rope = raw.get("rope_parameters") or {}
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        rope_scaling = raw.get("rope_scaling") or {
            k: v for k, v in full.items() if k != "rope_theta"
        }
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if raw.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        eos = raw.get("eos_token_id", 1)
        return cls(
            architecture="Gemma3ForCausalLM",
            vocab_size=raw.get("vocab_size", 262_208),
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim", 256),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta", full.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=raw.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True,
            rope_scaling=None if kind == "default" else {**rope_scaling, "rope_type": kind},
            sliding_window=raw.get("sliding_window", 4096),
            layer_types=list(layer_types),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
            rope_local_theta=float(
                raw.get("rope_local_base_freq", local.get("rope_theta", 10_000.0))
            ),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            bos_token_id=raw.get("bos_token_id", 2),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        with open(Path(model_dir) / "config.json") as f:
            return cls.from_dict(json.load(f))

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


def _sliding_window(raw: dict) -> int | None:
    # Qwen2 configs carry a window but switch it off with use_sliding_window.
    if raw.get("use_sliding_window") is False:
        return None
    return raw.get("sliding_window") or None


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a user's dtype choice to a torch dtype; "auto" picks per device.

    On CUDA "auto" is bf16. On CPU it is fp32 unless the CPU has native bf16 matmuls.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN can run bf16 matmuls natively (AVX512_BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass
class EngineConfig:
    """Knobs of the serving engine, validated on construction.

    kv_cache_memory is the KV cache budget in bytes; None sizes it from the device
    (a fraction of free GPU memory, or a fixed CPU default). kv_cache_dtype: "auto" (the
    model's dtype) or "int8" (kv_cache.py). quantization: see engine/quant/__init__.py.
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # None, or how the linear layers hold their weights: "int8", "int4", "gguf" (quant/)
    quantization: str | None = None
    # Launch each step before resolving the previous one's sampled tokens (None: on CUDA).
    overlap_steps: bool | None = None
    # Replay decode-only steps from CUDA graphs (None: on CUDA when Triton is installed).
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        from tokenmill.engine.quant import validate_name

        validate_name(self.quantization)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        from tokenmill.engine.worker.kv_cache import validate_kv_cache_dtype

        validate_kv_cache_dtype(self.kv_cache_dtype)
