"""A linear layer with what follows it run inside its matmul: an activation, a residual
add, or a multiply by another tensor (a gated MLP's up projection times its activated gate).

On CPU the engine holds dense weights oneDNN-packed (quant/packed_linear.py, a
`packed_weight` buffer); oneDNN then applies the activation, add or multiply to each
output tile while it is in cache, so the [rows, out] product is written once instead of
being written, read back and written again. Any other layer (F.linear, a quantized
kernel, CUDA) computes the same ops one after another in PyTorch. Either way the result
is what the separate ops give, to rounding: in bf16 the fused path rounds once, after the
post-op, where the separate ops round the product first. The exception is bf16 tanh-GELU,
which runs after the plain packed matmul in the native kernels (faster than oneDNN's
post-op); it rounds the product first, as the separate ops do.

The encoders (bert.py) and the vision towers (siglip.py, qwen2_5_vision.py) use it: their
layers are plain torch modules the text models' fused kernels never see.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import elementwise

# config.json's hidden_act -> (PyTorch function, oneDNN post-op, its algorithm)
ACTIVATIONS = {
    "gelu": (F.gelu, "gelu", "none"),
    "gelu_new": (functools.partial(F.gelu, approximate="tanh"), "gelu", "tanh"),
    "gelu_pytorch_tanh": (functools.partial(F.gelu, approximate="tanh"), "gelu", "tanh"),
    "gelu_fast": (functools.partial(F.gelu, approximate="tanh"), "gelu", "tanh"),
    "relu": (F.relu, "relu", ""),
    "silu": (F.silu, "swish", ""),
    "swish": (F.silu, "swish", ""),
}


def fused_linear(
    linear: nn.Module,
    x: torch.Tensor,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    times: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(x), then one of: the activation (a config.json hidden_act), + residual, or
    * times (a tensor of the output's shape).

    A layer holding a oneDNN-packed weight (`packed_weight`) runs it as a post-op of its
    matmul; any other computes the same in PyTorch.
    """
    if sum(op is not None for op in (activation, residual, times)) > 1:
        raise ValueError("fused_linear applies one post-op: an activation, a residual or times")
    packed = getattr(linear, "packed_weight", None)
    if packed is not None:
        x = x.contiguous()
        if residual is not None or times is not None:
            other, op = (residual, "add") if residual is not None else (times, "mul")
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, other.contiguous(), packed, linear.bias, op
            )
        if activation is not None:
            _, post_op, algorithm = ACTIVATIONS[activation]
            if algorithm == "tanh" and x.dtype == torch.bfloat16 and elementwise.supports(x):
                # oneDNN's gelu_tanh post-op measured slower than the plain matmul and a
                # native pass over its bf16 product (gelu.c)
                return elementwise.gelu_tanh_(linear(x))
            return torch.ops.mkldnn._linear_pointwise(
                x, packed, linear.bias, post_op, [], algorithm
            )
    out = linear(x)
    if activation is not None:
        return ACTIVATIONS[activation][0](out)
    if residual is not None:
        return out + residual
    if times is not None:
        return out * times
    return out
