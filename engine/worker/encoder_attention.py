"""Bidirectional attention over whole sequences packed back to back, with no padding.

The encoder runner lays a batch's sequences out sorted by length, so sequences of equal
length sit next to each other; each such run is one dense [count, heads, length,
head_dim] block, attended by one `scaled_dot_product_attention` call (PyTorch's fused
CPU and CUDA kernels, any dtype). A batch of mixed lengths costs one call per distinct
length and computes no padded position: a block-diagonal mask over the whole batch
would compute every cross-sequence score only to mask it, and per-sequence calls pay
the call overhead once per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from tokenmill.engine.models.attention import BidirectionalAttention


class PackedAttention(BidirectionalAttention):
    """One batch's attention, shared by its layers.

    Args:
        lengths: the tokens of each sequence, in batch order; sequences of equal length
            must be adjacent (the runner sorts them), and each such run is one call.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        runs: list[tuple[int, int, int]] = []  # (first row, number of sequences, length)
        row = 0
        for length in lengths:
            if runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == row:
                start, count, _ = runs[-1]
                runs[-1] = (start, count + 1, length)
            else:
                runs.append((row, 1, length))
            row += length
        self.runs = runs
        self.num_tokens = row

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q, k, v: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        for start, count, length in self.runs:
            rows = slice(start, start + count * length)
            shape = (count, length, num_heads, head_dim)
            # [count * length, heads, dim] -> [count, heads, length, dim] (views)
            attended = F.scaled_dot_product_attention(
                q[rows].view(shape).transpose(1, 2),
                k[rows].view(shape).transpose(1, 2),
                v[rows].view(shape).transpose(1, 2),
                scale=scale,
            )
            out[rows].view(shape).copy_(attended.transpose(1, 2))
        return out
