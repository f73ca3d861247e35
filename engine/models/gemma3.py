"""Gemma 3 (text): the Llama decoder with Gemma's differences, each computed as HF does.

- Embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first.
- RMSNorm scales by (1 + weight), in fp32, rounded once at the end; besides the usual
  pre-attention norm there is one after attention and one before and after the MLP, and
  q and k are RMS-normalised per head before rotary.
- The MLP is GeGLU (tanh-approximated GELU).
- Layers alternate between sliding-window (local) and global attention, as `layer_types`
  says; local layers rotate with their own base (`rope_local_base_freq`).
- Queries are scaled by query_pre_attn_scalar ** -0.5; logits may be soft-capped.

With the residual stream carried apart from each block's output (as in llama.py), the
residual adds fold into the pre-attention and pre-MLP norms: fused on CPU in fp32, where
(1 + weight) is just another RMSNorm weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import elementwise
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.config import (
    SLIDING_ATTENTION,
    ModelConfig,
    rope_scaling_of,
    token_ids_of,
)
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, declare, refused
from tokenmill.engine.models.layers import Embedding, GatedMLP, Linear
from tokenmill.engine.models.llama import LlamaAttention, LlamaForCausalLM
from tokenmill.engine.models.registry import (
    LLAMA_GGUF_BLOCK_NAMES,
    Architecture,
    GGUFLayout,
    register,
)
from tokenmill.engine.models.rope import Rope, RotaryEmbedding


@dataclass
class Gemma3Config(ModelConfig):
    """ModelConfig plus what only Gemma 3 has."""

    rope_local_theta: float = 10_000.0  # the rotary base of the sliding-window layers
    query_pre_attn_scalar: float = 256.0  # queries are scaled by its -1/2 power
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / cap) * cap


def parse_config(raw: dict) -> Gemma3Config:
    """Gemma 3 text configs: transformers 5 nests the rope bases by layer type in
    `rope_parameters`; older files keep `rope_theta` and `rope_local_base_freq`."""
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:  # transformers' default: every 6th layer is global
        pattern = raw.get("sliding_window_pattern", 6)
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
    rope = raw.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    rope_scaling = raw.get("rope_scaling") or {k: v for k, v in full.items() if k != "rope_theta"}
    max_positions = raw.get("max_position_embeddings", 131_072)
    # The local layers' rotary tables are plain rope of their own base.
    if rope_scaling_of({k: v for k, v in local.items() if k != "rope_theta"}, max_positions):
        raise ValueError("rope scaling on Gemma 3's sliding_attention layers is not supported")
    attention_bias = bool(raw.get("attention_bias", False))
    return Gemma3Config(
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
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=attention_bias,
        attention_output_bias=attention_bias,  # transformers' Gemma 3: q, k, v and o
        qk_norm=True,
        rope_scaling=rope_scaling_of(rope_scaling, max_positions),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=list(layer_types),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        rope_local_theta=float(raw.get("rope_local_base_freq", local.get("rope_theta", 10_000.0))),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        bos_token_id=raw.get("bos_token_id", 2),
        eos_token_ids=token_ids_of(raw.get("eos_token_id", 1)),
    )


class GemmaRMSNorm(nn.Module):
    """RMSNorm with the scale stored as an offset from one: x / rms(x) * (1 + weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._scale: torch.Tensor | None = None  # 1 + weight in fp32, made after loading

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); given the residual stream, rmsnorm(residual + x) and residual + x
        (the add in x's dtype, as HF adds; the fused kernel updates `residual` in place)."""
        scale = self._fp32_scale()
        if elementwise.supports(x):
            # q and k arrive as strided views of the qkv output: one copy and one fused pass
            # cost less than PyTorch's five passes over the view (10% of a prefill step).
            # bf16 rows take the fp32 scale as it is: scaled in fp32, rounded once.
            x = x.contiguous()
            if residual is None:
                return elementwise.rms_norm(x, scale, self.eps)
            if residual.is_contiguous():
                return elementwise.rms_norm(x, scale, self.eps, residual), residual
        if residual is None:
            return self._norm(x, scale)
        residual = residual + x
        return self._norm(residual, scale), residual

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # HF Gemma multiplies by (1 + w) in fp32 and rounds once (Llama rounds, then scales).
        normed = F.rms_norm(x.float(), scale.shape, scale, self.eps)
        return normed.to(x.dtype)

    def _fp32_scale(self) -> torch.Tensor:
        if self._scale is None or self._scale.device != self.weight.device:
            with torch.no_grad():
                self._scale = self.weight.detach().float() + 1.0
        return self._scale


class Gemma3Attention(LlamaAttention):
    """Llama attention with Gemma's q/k norms and query scale; the window comes from the
    layer's type."""

    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.is_local = config.layer_types[layer_idx] == SLIDING_ATTENTION


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, hidden, residual, rope: tuple[torch.Tensor, torch.Tensor], meta: StepAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward, with Gemma's extra norms.

        Args:
            hidden: [num_tokens, hidden] the previous layer's (post-normed) MLP output, or
                the scaled embeddings for the first layer
            residual: [num_tokens, hidden] the stream before it, None for the first layer
            rope: (cos, sin) of this layer's rotary base
        Returns:
            (this layer's post-normed MLP output, the stream before it)
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, *rope, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> the scaled embeddings [num_tokens, hidden]."""
        embeddings = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype before multiplying (25.25 in bf16).
        return embeddings * float(torch.tensor(self.embed_scale, dtype=embeddings.dtype))

    def forward(
        self, input_ids, cos, sin, meta: StepAttention, local_rope, embeddings=None
    ) -> torch.Tensor:
        """embeddings: the first layer's input when the caller made it (images placed in
        it); else `embed(input_ids)`."""
        hidden = self.embed(input_ids) if embeddings is None else embeddings
        residual = None
        for layer in self.layers:
            rope = local_rope if layer.self_attn.is_local else (cos, sin)
            hidden, residual = layer(hidden, residual, rope, meta)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model: a second rotary table, of the local base, for the local layers."""

    def __init__(self, config: Gemma3Config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.local_rotary: RotaryEmbedding | None = None

    def attach_rotary(self, max_positions: int, device: torch.device) -> None:
        super().attach_rotary(max_positions, device)
        c = self.config  # the local layers' base has no scaling
        local = Rope(c.head_dim, c.rope_local_theta)
        self.local_rotary = RotaryEmbedding(local, max_positions, device)

    def forward(
        self, input_ids, positions, meta: StepAttention, rope_variants=None
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]; the
        global layers' rope variants as LlamaForCausalLM.forward's."""
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary.lookup(positions, dtype, rope_variants)
        local_rope = self.local_rotary.lookup(positions, dtype)
        return self.model(input_ids, cos, sin, meta, local_rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_samples, hidden] -> fp32 logits [num_samples, vocab], soft-capped
        as tanh(logits / cap) * cap where the config sets a cap."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits


# llama.cpp's Gemma 3 constants, not written as metadata: every 6th layer is global, the
# local layers' rope base is 10k.
_GGUF_SLIDING_WINDOW_PATTERN = 6
_GGUF_ROPE_LOCAL_BASE = 10_000.0


def _gguf_config(config: dict, get) -> dict:
    """The Gemma 3 fields of config.json, as llama.cpp reads the file."""
    num_layers = config["num_hidden_layers"]
    pattern = _GGUF_SLIDING_WINDOW_PATTERN
    # llama.cpp scales queries by head_dim ** -0.5, except for the 62-layer 27B model, whose
    # query_pre_attn_scalar is hidden_size / num_heads.
    scalar = config["head_dim"]
    if num_layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "sliding_window": get("attention.sliding_window"),
        "layer_types": [
            SLIDING_ATTENTION if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ],
        "rope_local_base_freq": _GGUF_ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }


# transformers' Gemma3TextConfig, field by field.
CONFIG_FIELDS = declare(
    handled={
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_activation",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "rope_local_base_freq",
        "attention_bias",
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_pattern",
        "layer_types",
        "final_logit_softcapping",
        "bos_token_id",
        "eos_token_id",
    },
    harmless={
        **DECODER_HARMLESS,
        "_sliding_window_pattern": "transformers writes it beside layer_types, which it reads",
    },
    refused={
        "attn_logit_softcapping": refused("attention logits soft-capped (Gemma 2)"),
        "use_bidirectional_attention": refused("bidirectional attention (EmbeddingGemma)", False),
    },
)

register(
    Architecture(
        names=("Gemma3ForCausalLM",),
        model_class=Gemma3ForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("gemma3_text",),
        gguf=GGUFLayout(
            "gemma3",
            "Gemma3ForCausalLM",
            "gemma3_text",
            # Four norms per layer: llama.cpp's `ffn_norm` is the one before the MLP here.
            block_names={
                **LLAMA_GGUF_BLOCK_NAMES,
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            norm_offset=1.0,
            activation=("hidden_activation", "gelu_pytorch_tanh"),
            extra_config=_gguf_config,
        ),
    )
)
