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

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.kernels import elementwise
from tokenmill.engine.models.layers import GatedMLP, StepAttention
from tokenmill.engine.models.llama import LlamaAttention, LlamaForCausalLM


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

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.is_local = config.layer_types[layer_idx] == "sliding_attention"


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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, cos, sin, meta: StepAttention, local_rope) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # HF rounds the scale to the model dtype before multiplying (25.25 in bf16).
        scale = float(torch.tensor(self.embed_scale, dtype=embeddings.dtype))
        hidden, residual = embeddings * scale, None
        for layer in self.layers:
            rope = local_rope if layer.self_attn.is_local else (cos, sin)
            hidden, residual = layer(hidden, residual, rope, meta)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model. Its forward takes a second rotary table for the local layers."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids,
        cos,
        sin,
        meta: StepAttention,
        *,
        local_rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """input_ids: [num_tokens] -> hidden states [num_tokens, hidden].

        Args:
            cos, sin: [num_tokens, 1, head_dim] rotary of the global layers
            local_rope: (cos, sin) of the local layers' base
        """
        return self.model(input_ids, cos, sin, meta, local_rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_samples, hidden] -> fp32 logits [num_samples, vocab], soft-capped
        as tanh(logits / cap) * cap where the config sets a cap."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits
