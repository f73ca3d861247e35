"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary.

ModelConfig.qk_norm is on for this architecture, which adds q_norm/k_norm.
"""

from __future__ import annotations

from tokenmill.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
