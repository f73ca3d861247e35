"""Building blocks shared by the Llama-family models: RMSNorm, gated MLP (rotary: rope.py).

On CPU in fp32/bf16 the residual add + RMSNorm, rotary and SiLU-and-mul run as fused
native kernels (kernels/elementwise.py) that compute what the PyTorch code here computes;
the PyTorch code runs everywhere else.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import elementwise


class Linear(nn.Linear):
    """nn.Linear that skips initialisation: a model's weights are always loaded, and even
    dispatching an init on the meta device costs a second at start."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding that skips initialisation (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); or, given the residual stream, adds x to it first (vLLM's fused
        add-norm) and returns (rmsnorm(residual + x), residual + x). The fused kernel
        updates `residual` in place.
        """
        if self._is_fused(x, residual):
            if residual is None:
                return elementwise.rms_norm(x, self.weight, self.eps)
            return elementwise.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _is_fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            elementwise.supports(x)
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, exactly as HF Llama does,
        # so bf16 runs round the same way the reference does.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


# Gated MLP activations by their HF config name -> the PyTorch function.
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


# The same, fused with the multiply by `up` in one native pass: elementwise.<name>.
_FUSED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}
# The hidden_act values a gated MLP computes.
GATED_ACTIVATIONS = tuple(_ACTIVATIONS)


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU for Gemma) with gate and up projections fused into one
    matmul; `bias` puts a bias on each of the three projections (Llama's mlp_bias)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {activation!r}; supported: {list(_ACTIVATIONS)}"
            )
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "fused_activation", None) == self.activation:
            # An int8 gate_up whose kernel applies the activation in its epilogue
            # (quant/int8.py): no [num_tokens, 2 * intermediate] tensor is written.
            return self.down_proj(self.gate_up_proj(x, activation=self.activation))
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if elementwise.supports(gate_up):
            fused = getattr(elementwise, _FUSED_ACTIVATIONS[self.activation])
            return self.down_proj(fused(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # The activation allocates a fresh tensor; multiplying into it saves a second one.
        return self.down_proj(_ACTIVATIONS[self.activation](gate).mul_(up))
