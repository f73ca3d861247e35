"""The KV cache's block pool, with prefix caching.

Every full block is identified by a chained hash of (parent block's hash, its token
ids, the LoRA adapter the sequence runs with and its rope variant - keys and values
differ per adapter, and per rotary frequencies where they depend on the sequence's
length). A lookup is a hit only when the stored tokens, adapter, rope variant and parent
block match too, so a
hash collision can never serve another prefix's keys and values. Freed blocks
keep their hash and sit in an LRU free queue; they are evicted (their hash dropped)
only when the pool needs a block and none is free of cached content.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.core.images import block_image_key
from tokenmill.engine.core.step import Sequence
from tokenmill.engine.types.config import EngineConfig


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: tuple[int, ...],
    lora_id: int = 0,
    images: bytes = b"",
    rope_variant: int = 0,
) -> bytes:
    """Content hash of a full block, chained on its parent's hash. The adapter and the
    rope variant enter the root block's hash (a chain inherits them); the base model's
    hashes under variant 0 are what they were before there were either. `images`
    identifies the images whose tokens the block holds (core/images.py,
    `block_image_key`): their placeholder ids alone say nothing."""
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is None and lora_id:
        digest.update(b"lora:%d:" % lora_id)
    if parent_hash is None and rope_variant:
        digest.update(b"rope:%d:" % rope_variant)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    if images:
        digest.update(b"images:" + images)
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # set while the block is registered as cached
    parent_block_id: int | None = None  # the cached block before it in its chain
    lora_id: int = 0  # the adapter its keys and values were computed with
    images: bytes = b""  # the images its tokens hold (core/images.py, block_image_key)
    rope_variant: int = 0  # the rotary frequencies they were computed with

    def reset(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.parent_block_id = None
        self.lora_id = 0
        self.images = b""
        self.rope_variant = 0


class BlockManager:
    """Hands out fixed-size KV blocks to sequences; shares cached full blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = EngineConfig.enable_prefix_caching,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (first = evicted first). A free block that still
        # holds a hash stays findable until it reaches the front and is taken.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookups -------------------------------------------------------

    def block_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of seq's full blocks, each computed once as the sequence grows."""
        hashes = seq.block_hashes
        bs = self.block_size
        # A pending placeholder token has no id yet: its block is hashed once it has.
        for i in range(len(hashes), seq.num_resolved_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            images = block_image_key(seq.images, i * bs, (i + 1) * bs) if seq.images else b""
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens, seq.lora_id, images, seq.rope_variant))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached run of full blocks that prefixes seq's tokens.

        At most (num_tokens - 1) tokens are matched, so a request always computes at
        least its last token and has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(seq)
        bs = self.block_size
        hits: list[int] = []
        parent_id = None
        for i in range(min((seq.num_tokens - 1) // bs, len(hashes))):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            images = block_image_key(seq.images, i * bs, (i + 1) * bs) if seq.images else b""
            if (
                block.token_ids != tokens
                or block.parent_block_id != parent_id
                or block.lora_id != seq.lora_id
                or block.images != images
                or block.rope_variant != seq.rope_variant
            ):
                break  # a hash collision, not a hit
            hits.append(block_id)
            parent_id = block_id
        return hits

    # -- allocation -------------------------------------------------------------------

    def can_allocate(
        self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = ()
    ) -> bool:
        """Whether seq's block table can grow to hold num_tokens tokens."""
        return self._num_blocks_to_take(seq, num_tokens, cached_block_ids) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = ()) -> None:
        """Grow seq's block table to hold num_tokens tokens.

        cached_block_ids, a new sequence's prefix-cache hits, are shared first.
        """
        if self._num_blocks_to_take(seq, num_tokens, cached_block_ids) > self.num_free_blocks:
            raise RuntimeError("allocate() without can_allocate(): out of KV blocks")
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]  # touch: back in use, no longer evictable
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached_blocks += len(cached_block_ids)
        needed = self.blocks_needed(num_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def blocks_to_take(
        self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = ()
    ) -> int:
        """The free blocks growing seq's block table to num_tokens tokens takes."""
        return self._num_blocks_to_take(seq, num_tokens, cached_block_ids)

    def _num_blocks_to_take(self, seq: Sequence, num_tokens: int, cached_block_ids) -> int:
        # Reviving a free cached block takes it out of the free queue as well.
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        held = len(seq.block_table) + len(cached_block_ids)
        return revived + max(0, self.blocks_needed(num_tokens) - held)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]  # lazy eviction
        block.reset()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks are queued first so they are evicted first:
        a chain's head is the part other requests are most likely to share."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # nothing to keep
                else:
                    self.free_queue[block_id] = None
        seq.block_table.clear()
        seq.num_cached_blocks = 0

    def forget_cache(self) -> None:
        """Unregister every cached block (in use or free); later lookups all miss."""
        for block in self.blocks:
            block.reset()
        self.cached.clear()

    # -- registering computed blocks ---------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly computed full blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq)
        bs = self.block_size
        parent_id = None
        if seq.num_cached_blocks:
            last_id = seq.block_table[seq.num_cached_blocks - 1]
            parent_id = self.cached.get(hashes[seq.num_cached_blocks - 1], last_id)
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.parent_block_id = parent_id
            block.lora_id = seq.lora_id
            block.images = block_image_key(seq.images, i * bs, (i + 1) * bs) if seq.images else b""
            block.rope_variant = seq.rope_variant
            # If an identical block was computed concurrently, the first one registered
            # stays the cached copy (this one is still correct for its owner), and the
            # chain continues from it so lookups can follow it.
            parent_id = self.cached.setdefault(hashes[i], block.block_id)
        seq.num_cached_blocks = num_full
