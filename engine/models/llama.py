"""Llama-family decoder: Llama 2/3, SmolLM - and the base Mistral, Qwen2, Qwen3 and Gemma 3
build on.

The model is a plain nn.Module over a flat, unpadded batch of tokens: it embeds them,
runs the layers with attention over the paged cache (through the step's attention
metadata), and returns hidden states. Logits are computed separately, and only for the
positions that sample.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.config import ModelConfig, common_fields
from tokenmill.engine.models.config_fields import DECODER_HARMLESS, LLAMA_FAMILY_HANDLED, declare
from tokenmill.engine.models.layers import GATED_ACTIVATIONS, Embedding, GatedMLP, Linear, RMSNorm
from tokenmill.engine.models.registry import Architecture, GGUFLayout, register
from tokenmill.engine.models.rope import RotaryEmbedding, rotary_qkv


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Keys this layer's queries see: the last `sliding_window` positions, or all (None).
        self.sliding_window = config.layer_sliding_window(layer_idx)
        # gpt-oss: a learned logit per query head in the softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        # Views into the engine's KV cache, attached by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepAttention
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = rotary_qkv(q, k, v, cos, sin)
        o = meta.attend(
            q, k, v, self.k_cache, self.v_cache, self.scale, self.sliding_window, sinks=self.sinks
        )
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_mlp(config, layer_idx)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block: a gated MLP (a mixture of experts overrides it)."""
        return GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias
        )

    def forward(
        self, hidden, residual, cos, sin, meta: StepAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from each block's output, so that adding
        one to the other and normalising the sum is one fused op (vLLM's layout).

        Args:
            hidden: [num_tokens, hidden] the previous layer's MLP output (the embeddings
                for the first layer)
            residual: [num_tokens, hidden] the stream before that output, None for the
                first layer
        Returns:
            (this layer's MLP output, the stream before it)
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, cos, sin, meta: StepAttention, embeddings=None) -> torch.Tensor:
        """embeddings: the first layer's input when the caller made it (a vision model's
        image tokens placed in it); else the token embeddings."""
        hidden = self.embed_tokens(input_ids) if embeddings is None else embeddings
        residual = None  # hidden: [num_tokens, hidden]
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names -> (our parameter name, shard index) for fused projections.
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    base_model_class: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.base_model_class(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def attach_rotary(self, max_positions: int, device: torch.device) -> None:
        """Build the rotary tables for positions [0, max_positions) once, after loading."""
        self.rotary = RotaryEmbedding(self.config.rope, max_positions, device)

    def forward(
        self, input_ids, positions, meta: StepAttention, rope_variants=None
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden].

        rope_variants: [num_tokens] each token's sequence's rope variant (rope.py), for
        a rope whose frequencies depend on the sequence's length; None: all 0.
        """
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary.lookup(positions, dtype, rope_variants)
        return self.model(input_ids, cos, sin, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_samples, hidden] -> fp32 logits [num_samples, vocab]."""
        return self.lm_head(hidden).float()


def decoder_config(raw: dict, **overrides) -> ModelConfig:
    """A Llama-family ModelConfig (config.common_fields), its MLP activation checked.

    Raises:
        ValueError: a hidden_act the gated MLP does not compute (naming it).
    """
    config = ModelConfig(**common_fields(raw, **overrides))
    if config.hidden_act not in GATED_ACTIVATIONS:
        raise ValueError(
            f"hidden_act {config.hidden_act!r} is not supported for {config.architecture} "
            f"(supported: {', '.join(GATED_ACTIVATIONS)})"
        )
    return config


def parse_config(raw: dict) -> ModelConfig:
    return decoder_config(raw, max_position_embeddings=2048)


# transformers' LlamaConfig, field by field. A window (sliding_window, layer_types) is
# not Llama's: transformers' Llama attends to every position whatever they say, while a
# checkpoint that sets them was trained with one - refused either way (FOREIGN_FIELDS).
CONFIG_FIELDS = declare(
    handled=LLAMA_FAMILY_HANDLED | {"attention_bias", "mlp_bias"},
    harmless={
        **DECODER_HARMLESS,
        "pretraining_tp": "transformers 5 does not read it (it split pretraining's matmuls)",
    },
)

register(
    Architecture(
        names=("LlamaForCausalLM",),
        model_class=LlamaForCausalLM,
        parse_config=parse_config,
        config_fields=CONFIG_FIELDS,
        model_types=("llama",),
        gguf=GGUFLayout("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
    )
)
