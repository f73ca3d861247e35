"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections.

ModelConfig.attention_bias is on for this architecture, which gives qkv_proj a bias.
"""

from __future__ import annotations

from tokenmill.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
