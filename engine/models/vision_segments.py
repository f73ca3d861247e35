"""Where the patches of a Qwen2.5-VL (or Qwen2-VL) tower call go, and attention within
the variable-length segments they form.

A call's images are one flat sequence of patches, no image padded. Every block attends
within segments of it: the windows of each image (`window_size` pixels a side, the last
row and column of windows partial), or, in the full-attention blocks, whole images.

Which order the windows take is free: attention within a window or an image does not
depend on it, each patch carries its own rotary position, and the merged tokens are put
back in image order at the end. So the windows of a call are ordered by length (stable:
then by image, then row-major), whole merge groups moving together. Segments of equal
length then lie back to back, and a window block reads each length's windows in place
as one [count, length] batch - one scaled-dot-product call per distinct length, no copy.
An image is spread over the length groups when its windows differ in length, so only the
full-attention blocks (4 of Qwen2.5-VL's 32) gather its patches, and scatter them back.
The layout is built with a few whole-tensor ops per image, not per window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class SegmentGroup:
    """`count` segments of `length` rows each: the rows [start, start + count * length)
    of the flat sequence (read in place), or, where start is None, gathered by `rows`."""

    count: int
    length: int
    start: int | None = None
    rows: torch.Tensor | None = None  # [count, length] int64, on the tower's device

    @property
    def end(self) -> int | None:
        return None if self.start is None else self.start + self.count * self.length


@dataclass(frozen=True)
class Segments:
    """A flat sequence cut into segments, grouped by length."""

    groups: tuple[SegmentGroup, ...]

    @classmethod
    def of(cls, rows: Sequence[torch.Tensor], device: torch.device) -> Segments:
        """From each segment's rows (1-D int64 on the CPU, a segment's rows ascending)."""
        by_length: dict[int, list[torch.Tensor]] = {}
        for segment in rows:
            by_length.setdefault(len(segment), []).append(segment)
        groups = []
        for length, members in by_length.items():
            stacked = torch.stack(members)
            start = int(stacked[0, 0])
            if torch.equal(stacked.view(-1), torch.arange(start, start + stacked.numel())):
                groups.append(SegmentGroup(len(members), length, start=start))
            else:
                groups.append(SegmentGroup(len(members), length, rows=stacked.to(device)))
        return cls(tuple(groups))

    @classmethod
    def back_to_back(cls, lengths: torch.Tensor) -> Segments:
        """Segments of these lengths one after another, equal lengths adjacent."""
        values, counts = torch.unique_consecutive(lengths, return_counts=True)
        groups, start = [], 0
        for length, count in zip(values.tolist(), counts.tolist()):
            groups.append(SegmentGroup(count, length, start=start))
            start += count * length
        return cls(tuple(groups))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v: [rows, heads, head_dim]
    (any row stride) -> [rows, heads, head_dim]."""
    rows, heads, head_dim = q.shape

    def attend(*batch: torch.Tensor) -> torch.Tensor:
        """[count, length, heads, head_dim] each -> the same shape."""
        q_rows, k_rows, v_rows = (t.transpose(1, 2) for t in batch)
        return F.scaled_dot_product_attention(q_rows, k_rows, v_rows, scale=scale).transpose(1, 2)

    only = segments.groups[0] if len(segments.groups) == 1 else None
    if only is not None and only.start == 0 and only.end == rows:
        # One length over the whole call: the result is already in row order.
        batch = (t.view(only.count, only.length, heads, head_dim) for t in (q, k, v))
        return attend(*batch).reshape(rows, heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in segments.groups:
        shape = (group.count, group.length, heads, head_dim)
        if group.start is not None:
            span = slice(group.start, group.end)
            out[span] = attend(*(t[span].view(shape) for t in (q, k, v))).reshape(-1, *shape[2:])
        else:
            gathered = (t[group.rows] for t in (q, k, v))  # [count, length, heads, head_dim]
            out[group.rows.reshape(-1)] = attend(*gathered).reshape(-1, *shape[2:])
    return out


@dataclass(frozen=True)
class TowerLayout:
    """A call's patches in window order: which merged token each place takes, each
    patch's row and column within its image, and the segments of both kinds."""

    window_order: torch.Tensor  # [num_tokens] merged-token indices (image order), in window order
    rows: torch.Tensor  # [num_patches] patch row within its image, in window order
    columns: torch.Tensor  # [num_patches]
    images: Segments
    windows: Segments


def tower_layout(
    grids: Sequence[tuple[int, int, int]],
    *,
    merge_size: int,
    window_tokens: int | None,
    device: torch.device,
) -> TowerLayout:
    """The layout of images of these grids (frames, rows, columns of patches), merged
    `merge_size` a side, in windows of `window_tokens` merged tokens a side (None: each
    image is one window)."""
    if not grids:
        raise ValueError("a tower call takes at least one image")
    unit = merge_size**2
    token_rows, token_columns, window_of, image_of = [], [], [], []
    windows_before = 0
    for index, (frames, height, width) in enumerate(grids):
        if frames != 1:
            raise ValueError(f"a grid of {frames} frames is a video; only images are supported")
        if height < 1 or width < 1 or height % merge_size or width % merge_size:
            raise ValueError(f"grid {height}x{width} is not a multiple of merge size {merge_size}")
        rows_here, columns_here = height // merge_size, width // merge_size
        row = torch.arange(rows_here).repeat_interleave(columns_here)
        column = torch.arange(columns_here).repeat(rows_here)
        if window_tokens is None:
            window = torch.zeros_like(row)
        else:
            windows_across = -(-columns_here // window_tokens)
            window = row // window_tokens * windows_across + column // window_tokens
        window_of.append(window + windows_before)
        windows_before += int(window.max()) + 1
        token_rows.append(row)
        token_columns.append(column)
        image_of.append(torch.full_like(row, index))
    window = torch.cat(window_of)  # each merged token's window, numbered across the call
    window_length = torch.bincount(window)  # in merged tokens
    by_length = torch.sort(window_length, stable=True).indices  # window numbers
    rank = torch.empty_like(by_length)
    rank[by_length] = torch.arange(len(by_length))
    order = torch.sort(rank[window], stable=True).indices  # merged tokens, in window order

    in_group = torch.arange(unit)
    rows = (torch.cat(token_rows)[order, None] * merge_size + in_group // merge_size).view(-1)
    columns = (torch.cat(token_columns)[order, None] * merge_size + in_group % merge_size).view(-1)
    image_at = torch.cat(image_of)[order]  # each place's image
    image_rows = []
    for index in range(len(grids)):
        places = (image_at == index).nonzero().view(-1)
        image_rows.append((places[:, None] * unit + in_group).view(-1))
    return TowerLayout(
        window_order=order.to(device),
        rows=rows.to(device),
        columns=columns.to(device),
        images=Segments.of(image_rows, device),
        windows=Segments.back_to_back(window_length[by_length] * unit),
    )
