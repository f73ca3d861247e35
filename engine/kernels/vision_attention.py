"""Python side of vision_attention.c: a vision tower's bidirectional attention over each
image's patches on AMX tiles, where the CPU has them (`available`); the towers call
PyTorch's scaled_dot_product_attention elsewhere."""

from __future__ import annotations

import ctypes

import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.interface import VisionAttentionArgs, check_status


def available() -> bool:
    """Whether tm_vision_attention runs here (built for AMX-BF16, tiles granted)."""
    native = native_library()
    return native is not None and native.limits.vision_attention_amx


def _rows(t: torch.Tensor, name: str, shape: tuple[int, int, int]) -> int:
    """The stride between t's tokens, after checking t is [images, patches, hidden] bf16
    whose tokens are evenly spaced rows with contiguous channels (a view into a fused
    projection's output is fine)."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu":
        raise ValueError(f"{name} must be bf16 on CPU, not {t.dtype} on {t.device.type}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, not {shape}")
    images, patches, _ = shape
    row = t.stride(1)
    if t.stride(2) != 1 or (images > 1 and t.stride(0) != patches * row):
        raise ValueError(f"{name}'s tokens are not evenly spaced rows (strides {t.stride()})")
    return row


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float
) -> torch.Tensor:
    """softmax(scale * q k^T) v per image and head, every patch seeing every patch of its
    image.

    Args:
        q, k, v: bf16 [num_images, num_patches, num_heads * head_dim], heads contiguous
            within a token.
    Returns:
        bf16 [num_images, num_patches, num_heads * head_dim], contiguous.
    Raises:
        RuntimeError: the kernel does not run on this CPU (check `available` first).
        ValueError: a shape, dtype or layout it does not take.
    """
    images, patches, hidden = q.shape
    if hidden % num_heads:
        raise ValueError(f"hidden size {hidden} is not {num_heads} heads")
    shape = (images, patches, hidden)
    strides = [_rows(t, name, shape) for t, name in ((q, "q"), (k, "k"), (v, "v"))]
    out = torch.empty(shape, dtype=torch.bfloat16)
    args = VisionAttentionArgs(
        q=q.data_ptr(),
        k=k.data_ptr(),
        v=v.data_ptr(),
        out=out.data_ptr(),
        num_images=images,
        seq_len=patches,
        num_heads=num_heads,
        head_dim=hidden // num_heads,
        q_stride=strides[0],
        k_stride=strides[1],
        v_stride=strides[2],
        scale=scale,
        num_threads=torch.get_num_threads(),
    )
    native = native_library()
    if native is None:
        raise RuntimeError("the native kernels are not available")
    what = f"vision attention over {patches} patches, {num_heads} heads of {hidden // num_heads}"
    check_status(native.lib.tm_vision_attention(ctypes.byref(args)), what)
    return out
