"""Fused elementwise ops for the CPU forward pass, over the native library.

Residual add + RMSNorm, rotary on q and k, and SiLU- or GELU-and-mul each run as one pass in C
(elementwise.c) where PyTorch makes several, with a temporary per pass. They compute
what the PyTorch code in layers.py computes, to the bit for RMSNorm, the residual add
and rotary (SiLU and GELU may differ in the last bit). Callers check `supports` first and keep
their PyTorch code for everything else (CUDA, fp16, no compiler). Set
TOKENMILL_FUSED_OPS=0 to keep the PyTorch code on CPU too (the native attention stays).
`gelu_tanh_` (gelu.c) is the SigLIP tower's activation after its fc1 matmul, in place;
`add_layer_norm` (layer_norm.c) its residual add and the LayerNorm after it, in one pass.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.engine import env
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import (
    LayerNormArgs,
    RMSNormArgs,
    RotaryArgs,
    SiluArgs,
    check_status,
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    native = native_library() if env.FUSED_OPS.is_on() else None
    return None if native is None else native.lib


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops run for tensors like x (CPU, fp32 or bf16, library built)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and _library() is not None
    )


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension, after `residual += x` when a residual is given.

    Args:
        x: [..., dim], contiguous
        weight: [dim], x's dtype; or fp32 for bf16 x, which then is normalised and scaled
            in fp32 and rounded once (Gemma's (1 + weight), as HF computes it)
        residual: like x; updated in place to residual + x
    Returns:
        rmsnorm(residual + x) * weight, or rmsnorm(x) * weight without a residual.
    """
    dim = weight.shape[0]
    fp32_weight = x.dtype == torch.bfloat16 and weight.dtype == torch.float32
    if not x.is_contiguous() or (weight.dtype != x.dtype and not fp32_weight) or x.shape[-1] != dim:
        raise ValueError(
            "rms_norm needs a contiguous x and a weight of x's width, in x's dtype (or fp32)"
        )
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError("the residual must be contiguous and shaped like x")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError("the residual must have x's dtype")
    out = torch.empty_like(x)
    args = RMSNormArgs(
        x=x.data_ptr(),
        residual=None if residual is None else residual.data_ptr(),
        out=out.data_ptr(),
        weight=weight.contiguous().data_ptr(),
        rows=x.numel() // dim,
        dim=dim,
        eps=eps,
        is_bf16=_is_bf16(x),
        num_threads=torch.get_num_threads(),
        fp32_weight=int(fp32_weight),
    )
    check_status(_library().tm_rms_norm(ctypes.byref(args)), f"rms_norm over {dim} values")
    return out


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_supports(q, k, v, cos) -> bool:
    """Whether `rotary_qkv` takes these tensors: each token's heads contiguous, one dtype."""
    return (
        supports(q)
        and all(t.dtype == q.dtype and _heads_contiguous(t) for t in (q, k, v))
        and cos.dtype == q.dtype
        and cos.shape == (q.shape[0], 1, q.shape[2])
    )


def rotary_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary (rotate halves) on q and k, and v copied out, in one pass over the tokens.

    Args:
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
            Any row stride (views into the qkv projection's output), heads contiguous.
        cos, sin: [num_tokens, 1, head_dim], q's dtype (RotaryEmbedding.lookup)
    Returns:
        q, k rotated and v, all contiguous.
    """
    if not rotary_supports(q, k, v, cos):
        raise ValueError("rotary_qkv needs fp32/bf16 CPU tensors with contiguous heads")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    v_out = torch.empty(v.shape, dtype=v.dtype)
    args = RotaryArgs(
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        q_stride=q.stride(0),
        k_stride=k.stride(0),
        v_stride=v.stride(0),
        q_out=q_out.data_ptr(),
        k_out=k_out.data_ptr(),
        v_out=v_out.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        is_bf16=_is_bf16(q),
        num_threads=torch.get_num_threads(),
    )
    check_status(_library().tm_rotary_qkv(ctypes.byref(args)), f"rotary, head_dim {head_dim}")
    return q_out, k_out, v_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] on the last dimension: [..., 2 * dim] -> [..., dim]."""
    return _gated_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up] (Gemma's GeGLU), as
    `silu_and_mul`."""
    return _gated_and_mul(x, "gelu_tanh")


def _gated_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    x = x.contiguous()
    dim = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], dim, dtype=x.dtype)
    args = SiluArgs(
        x=x.data_ptr(),
        out=out.data_ptr(),
        rows=x.numel() // (2 * dim),
        dim=dim,
        is_bf16=_is_bf16(x),
        num_threads=torch.get_num_threads(),
    )
    function = getattr(_library(), f"tm_{activation}_and_mul")
    check_status(function(ctypes.byref(args)), f"{activation}_and_mul over {dim}")
    return out


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """x = gelu(x, approximate="tanh"), in place (gelu.c); returns x. Within about 1e-5
    relative of the formula in fp32, so bf16 results are PyTorch's or one ulp from them."""
    if not supports(x) or not x.is_contiguous():
        raise ValueError("gelu_tanh_ needs a contiguous fp32 or bf16 CPU tensor")
    if x.numel() == 0:
        return x
    args = SiluArgs(
        x=x.data_ptr(),
        out=x.data_ptr(),
        rows=1,
        dim=x.numel(),
        is_bf16=_is_bf16(x),
        num_threads=torch.get_num_threads(),
    )
    check_status(_library().tm_gelu_tanh(ctypes.byref(args)), f"gelu_tanh over {x.numel()}")
    return x


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum = x + residual (written over x), and LayerNorm(sum) * weight + bias, in one pass
    (layer_norm.c): within an ulp or so of PyTorch's add and F.layer_norm.

    Args:
        x, residual: [..., dim], contiguous, one dtype; x is overwritten with the sum
        weight, bias: [dim], x's dtype
    Returns:
        (the sum, which is x, the normalised sum)
    """
    dim = weight.shape[0]
    same = all(t.dtype == x.dtype for t in (residual, weight, bias))
    if not (supports(x) and same and x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("add_layer_norm needs contiguous CPU x and residual, one fp32/bf16 dtype")
    if residual.shape != x.shape or x.shape[-1] != dim or bias.shape != (dim,):
        raise ValueError(
            f"add_layer_norm: x {tuple(x.shape)}, residual "
            f"{tuple(residual.shape)}, weight of {dim}, bias {tuple(bias.shape)}"
        )
    out = torch.empty_like(x)
    args = LayerNormArgs(
        x=x.data_ptr(),
        residual=residual.data_ptr(),
        sum=x.data_ptr(),
        out=out.data_ptr(),
        weight=weight.contiguous().data_ptr(),
        bias=bias.contiguous().data_ptr(),
        rows=x.numel() // dim,
        dim=dim,
        eps=eps,
        is_bf16=_is_bf16(x),
        num_threads=torch.get_num_threads(),
    )
    check_status(_library().tm_add_layer_norm(ctypes.byref(args)), f"add_layer_norm over {dim}")
    return x, out
