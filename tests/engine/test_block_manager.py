"""BlockManager with block_size=4: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest
import torch

import tokenmill.engine.core.block_manager as bm_module
from tokenmill.engine.core.block_manager import BlockManager
from tokenmill.engine.core.images import ImageSpan
from tokenmill.engine.core.step import Sequence
from tokenmill.engine.types.sampling_params import SamplingParams

_ids = iter(range(10**6))


def seq(tokens: list[int], lora_id: int = 0, rope_variant: int = 0) -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        request_id="r",
        index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        lora_id=lora_id,
        rope_variant=rope_variant,
    )


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """What the scheduler does for a new sequence: share hits, allocate the rest."""
    hits = bm.find_cached_prefix(s)
    bm.allocate(s, s.num_tokens, hits)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return hits


def test_allocation_takes_blocks_in_order_and_counts_refs():
    bm = BlockManager(8, 4)
    a = seq(list(range(10)))  # 3 blocks: 2 full + 1 partial
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert a.num_cached_blocks == 2  # only full blocks are registered


def test_shared_prefix_is_served_from_cache():
    bm = BlockManager(8, 4)
    a = seq(list(range(10)))
    admit(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert bm.num_free_blocks == 4


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, 4)
    admit(bm, seq(list(range(8))))
    # An identical 8-token prompt may reuse only its first block: the last token must
    # be computed to produce logits.
    assert bm.find_cached_prefix(seq(list(range(8)))) == [0]
    assert bm.find_cached_prefix(seq(list(range(9)))) == [0, 1]


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = BlockManager(4, 4)
    a = seq(list(range(12)))  # blocks 0, 1, 2 full
    admit(bm, a)
    bm.free(a)
    # Free queue: the never-used block 3 first, then a's blocks tail first.
    assert list(bm.free_queue) == [3, 2, 1, 0]
    assert all(bm.blocks[i].ref_count == 0 for i in range(4))
    # Still findable while free.
    assert bm.find_cached_prefix(seq(list(range(12)) + [0])) == [0, 1, 2]

    b = seq([50, 51, 52, 53, 54, 55])  # needs 2 blocks: takes 3, then evicts 2
    admit(bm, b)
    assert b.block_table == [3, 2]
    assert bm.find_cached_prefix(seq(list(range(12)) + [0])) == [0, 1]


def test_hit_on_free_block_touches_it_out_of_the_free_queue():
    bm = BlockManager(4, 4)
    a = seq(list(range(8)))
    admit(bm, a)
    bm.free(a)
    b = seq(list(range(8)) + [7])
    assert admit(bm, b) == [0, 1]
    assert 0 not in bm.free_queue and 1 not in bm.free_queue
    assert bm.blocks[0].ref_count == 1
    assert b.block_table == [0, 1, 2]  # the third block comes from the front of the queue


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(3, 4)
    a = seq(list(range(8)))
    admit(bm, a)
    bm.free(a)
    b = seq(list(range(8)) + [1, 2, 3, 4, 5])  # 2 hits (free) + 2 new blocks = 4 > 3
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert not bm.can_allocate(b, b.num_tokens, hits)
    with pytest.raises(RuntimeError):
        bm.allocate(b, b.num_tokens, hits)


def test_hash_collision_never_serves_other_tokens(monkeypatch):
    # Every block hashes the same: only the token (and parent) check stands between a
    # lookup and another prefix's keys and values.
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, *rest: b"same")
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(seq([9, 9, 9, 9, 5])) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == [0]


def test_blocks_are_shared_only_under_the_same_rope_variant(monkeypatch):
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 0], rope_variant=1))  # blocks 0, 1: long factors
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0], rope_variant=40)) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0], rope_variant=1)) == [0, 1]
    assert bm_module.hash_block_tokens(
        None, (1, 2), 0, rope_variant=1
    ) != bm_module.hash_block_tokens(None, (1, 2), 1, rope_variant=0)
    # Even when the hashes collide, the stored variant refuses the hit.
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda *args: b"same")
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5], rope_variant=1))
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], rope_variant=1)) == [0]


def test_blocks_are_shared_only_under_the_same_adapter():
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 0], lora_id=1))  # blocks 0, 1 under adapter 1
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == []  # the base model
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0], lora_id=2)) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0], lora_id=1)) == [0, 1]
    # The base model's hashes are what they were before there were adapters.
    assert bm_module.hash_block_tokens(None, (1, 2)) == bm_module.hash_block_tokens(None, (1, 2), 0)
    assert bm_module.hash_block_tokens(None, (1, 2), 1) != bm_module.hash_block_tokens(
        None, (1, 2), 2
    )


def test_hash_collision_across_adapters_is_a_miss(monkeypatch):
    # Every block hashes the same, adapter or not: the stored adapter is checked too.
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, *rest: b"same")
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5], lora_id=3))
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], lora_id=4)) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], lora_id=3)) == [0]


def test_same_block_under_another_prefix_is_a_miss():
    bm = BlockManager(8, 4)
    admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Second block's tokens match, but its parent differs.
    assert bm.find_cached_prefix(seq([9, 9, 9, 9, 5, 6, 7, 8, 0])) == []


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, seq(list(range(9))))
    assert bm.find_cached_prefix(seq(list(range(9)))) == []
    assert bm.cached == {}


def _with_image(tokens: list[int], offset: int, length: int, content: bytes) -> Sequence:
    s = seq(tokens)
    s.images = (ImageSpan(offset, length, content, torch.zeros(0)),)
    return s


def test_blocks_holding_an_image_are_shared_only_for_the_same_image():
    """Every image's tokens are the same placeholder id: the image's hash keys its blocks,
    and the chain carries it to the blocks after it."""
    bm = BlockManager(16, 4)
    tokens = [1, 2, 9, 9, 9, 9, 3, 4, 5, 6, 0]  # the image at positions 2..5
    admit(bm, _with_image(tokens, 2, 4, b"cat"))
    assert bm.find_cached_prefix(_with_image(tokens, 2, 4, b"cat")) == [0, 1]
    assert bm.find_cached_prefix(_with_image(tokens, 2, 4, b"dog")) == []
    assert bm.find_cached_prefix(seq(tokens)) == []


def test_hash_collision_across_images_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, *rest: b"same")
    bm = BlockManager(8, 4)
    admit(bm, _with_image([9, 9, 9, 9, 5], 0, 4, b"cat"))
    assert bm.find_cached_prefix(_with_image([9, 9, 9, 9, 5], 0, 4, b"dog")) == []
    assert bm.find_cached_prefix(_with_image([9, 9, 9, 9, 5], 0, 4, b"cat")) == [0]
