"""Attention for a step whose prompt chunks hold images: an image's tokens also see the
later tokens of the same image (bidirectional within it), as transformers masks Gemma 3.

The step's backend attends every row causally, as always (and writes the keys and
values into the cache); then the rows of each image are attended again with the image
mask: query position p sees key position j when j <= p or j lies in p's image, and,
in a local layer, p - j < window. The scheduler never splits an image across chunks,
so every key a row needs is in the cache or in this step's own keys. Image rows are a
small share of a step's rows (they occur in prompts only), so the second pass is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.worker.attention.portable import gather_key_blocks, gather_value_blocks


@dataclass
class ImageRows:
    """One image's query rows in one step."""

    first_row: int  # row of the first of them in the flat batch
    first_position: int  # its position
    num_rows: int
    image_offset: int  # the image's first and one-past-last positions
    image_end: int
    chunk_row: int  # row and position of the first token of the chunk they belong to
    chunk_position: int
    context_blocks: torch.Tensor | None  # blocks holding positions [0, chunk_position)


@dataclass
class ImageSpanAttention(StepAttention):
    inner: StepAttention
    images: list[ImageRows]
    # Whether the cache holds bf16 blocks in the native kernels' pair layout.
    pair_layout: bool = False

    def attend(self, q, k, v, k_cache, v_cache, scale, sliding_window=None, sinks=None):
        if sinks is not None:  # image rows are Gemma 3's, which has none
            raise ValueError("attention over image spans does not compute attention sinks")
        out = self.inner.attend(q, k, v, k_cache, v_cache, scale, sliding_window)
        for image in self.images:
            rows = slice(image.first_row, image.first_row + image.num_rows)
            out[rows] = self._image_rows(
                image, q[rows], k, v, k_cache, v_cache, scale, sliding_window
            )
        return out

    def _image_rows(self, image: ImageRows, q, k, v, k_cache, v_cache, scale, window):
        """[num_rows, heads, head_dim] attended over positions [0, image_end) with the mask."""
        num_new = image.image_end - image.chunk_position
        new = slice(image.chunk_row, image.chunk_row + num_new)
        keys, values = k[new].transpose(0, 1), v[new].transpose(0, 1)  # [kv_heads, n, dim]
        if image.chunk_position:
            ids = image.context_blocks[None]
            kc, vc = k_cache, v_cache
            if self.pair_layout:
                kc, vc = _plain_blocks(k_cache, v_cache, image.context_blocks)
                ids = torch.arange(len(image.context_blocks), device=q.device)[None]
            cached_k = gather_key_blocks(kc, ids)[0, :, : image.chunk_position]
            cached_v = gather_value_blocks(vc, ids)[0, :, : image.chunk_position]
            keys = torch.cat([cached_k.to(keys.dtype), keys], dim=1)
            values = torch.cat([cached_v.to(values.dtype), values], dim=1)
        device = q.device
        query_pos = torch.arange(
            image.first_position, image.first_position + image.num_rows, device=device
        )
        key_pos = torch.arange(image.image_end, device=device)
        back = query_pos[:, None] - key_pos[None, :]
        mask = (back >= 0) | (key_pos[None, :] >= image.image_offset)
        if window:
            mask &= back < window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)


def _plain_blocks(k_cache, v_cache, block_ids: torch.Tensor):
    """The blocks `block_ids` of a pair-layout cache (kernels/paged_attention.py) in the
    plain layout."""
    k = k_cache.index_select(0, block_ids)
    v = v_cache.index_select(0, block_ids)
    blocks, heads, dim, size = k.shape
    k = k.view(blocks, heads, dim // 2, size, 2).transpose(-1, -2).reshape(blocks, heads, dim, size)
    v = v.view(blocks, heads, size // 2, dim, 2).transpose(-1, -2).reshape(blocks, heads, size, dim)
    return k, v
