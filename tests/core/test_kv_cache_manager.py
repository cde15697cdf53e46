"""Exact tests of the KV-cache manager: block ids, ref counts, hash chain, eviction order, events."""

from __future__ import annotations

import hashlib
import struct

import pytest

from baton_engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from baton_engine.core.request import Request
from baton_engine.prefix.events import AllBlocksCleared, BlocksRemoved, BlocksStored
from baton_engine.prefix.hashing import fast_prefix_hash

BS = 4


def key(parent: int | None, tokens: list[int]) -> int:
    """The default chain key, recomputed independently of the implementation."""
    data = b"" if parent is None else struct.pack("<Q", parent)
    data += struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain(tokens: list[int]) -> list[int]:
    keys: list[int] = []
    parent = None
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = key(parent, tokens[start : start + BS])
        keys.append(parent)
    return keys


def admit(bm: KVCacheManager, req_id: int, tokens: list[int]) -> Request:
    request = Request(req_id, tokens)
    hits = bm.find_prefix_hits(request)
    assert hits is not None
    blocks = bm.allocate(request, hits)
    assert blocks.block_ids == bm.block_ids(req_id) and blocks.num_hit_blocks == hits
    return request


def test_default_hash_matches_independent_recomputation() -> None:
    assert fast_prefix_hash(None, (1, 2, 3, 4)) == key(None, [1, 2, 3, 4])
    parent = key(None, [1, 2, 3, 4])
    assert fast_prefix_hash(parent, (5, 6, 7, 8)) == key(parent, [5, 6, 7, 8])
    assert fast_prefix_hash(None, (1, 2, 3, 4)) != fast_prefix_hash(None, (1, 2, 3, 5))


def test_allocate_publish_and_hit() -> None:
    bm = KVCacheManager(10, BS)
    tokens = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = admit(bm, 0, tokens)
    assert bm.block_ids(a.req_id) == [0, 1, 2]
    assert bm.num_published_blocks(a.req_id) == 0
    assert [bm.ref_counts[b] for b in range(4)] == [1, 1, 1, 0]
    assert bm.take_events() == []  # nothing is published at allocation

    # Before the forward wrote the KV, the same prompt gets no hit.
    probe = Request(99, tokens)
    assert bm.find_prefix_hits(probe) == 0

    bm.publish(a, 10)  # the forward computed all 10 tokens
    k0, k1 = chain(tokens)
    assert bm.take_events() == [
        BlocksStored(
            block_hashes=(k0, k1), parent_block_hash=None, token_ids=tuple(range(1, 9)), block_size=BS
        )
    ]
    assert bm.lookup(k0) == 0 and bm.lookup(k1) == 1
    assert bm.block_keys_of(a.req_id) == [k0, k1]

    b = admit(bm, 1, tokens[:8] + [50, 51])
    assert bm.block_ids(b.req_id) == [0, 1, 3]
    assert bm.num_published_blocks(b.req_id) == 2  # the hits count as published
    assert [bm.ref_counts[i] for i in range(4)] == [2, 2, 1, 1]
    assert bm.usage() == pytest.approx(4 / 10)


def test_last_prompt_block_is_never_a_hit() -> None:
    bm = KVCacheManager(10, BS)
    tokens = list(range(1, 9))  # exactly two full blocks
    a = admit(bm, 0, tokens)
    bm.publish(a, 8)
    b = Request(1, tokens)
    assert bm.find_prefix_hits(b) == 1  # block 2 would leave nothing to compute
    assert bm.allocate(b, 1) == KVCacheBlocks([0, 2], num_hit_blocks=1)
    assert bm.block_ids(b.req_id) == [0, 2]


def test_publish_only_full_computed_blocks_and_continue_chain() -> None:
    bm = KVCacheManager(10, BS)
    tokens = list(range(1, 14))  # 13 tokens
    a = admit(bm, 0, tokens)
    bm.publish(a, 6)  # first chunk: 6 tokens computed -> only block 0 is full
    k = chain(tokens)
    assert bm.take_events() == [BlocksStored((k[0],), None, (1, 2, 3, 4), BS)]
    bm.publish(a, 13)  # second chunk
    assert bm.take_events() == [BlocksStored((k[1], k[2]), k[0], tuple(range(5, 13)), BS)]
    assert bm.num_published_blocks(a.req_id) == 3


def test_free_tail_first_and_eviction_order() -> None:
    bm = KVCacheManager(6, BS)
    a = admit(bm, 0, list(range(1, 14)))  # blocks 0,1,2,3
    bm.publish(a, 13)
    bm.take_events()
    k = chain(list(range(1, 14)))
    bm.free(a.req_id)
    assert bm.ref_counts == [0] * 6
    # Tail first: block 2 is the least recently freed cached block, then 1, then 0.
    # Block 3 (partial, never keyed) went back to the vacant heap.
    assert bm.cached_free_blocks() == [2, 1, 0]
    assert bm.num_free_blocks == 6

    # Vacant blocks 3, 4, 5 are used before any cached block is evicted.
    b = admit(bm, 1, [90] * 12)
    assert bm.block_ids(b.req_id) == [3, 4, 5]
    assert bm.take_events() == []
    c = admit(bm, 2, [80] * 5)
    assert bm.block_ids(c.req_id) == [2, 1]
    assert bm.take_events() == [BlocksRemoved((k[2],)), BlocksRemoved((k[1],))]
    assert bm.lookup(k[2]) is None and bm.lookup(k[1]) is None
    assert bm.lookup(k[0]) == 0
    # The head block survived and still hits.
    d = Request(3, list(range(1, 14)))
    assert bm.find_prefix_hits(d) is None  # one hit, but 3 more blocks needed and 0 free
    bm.free(b.req_id)
    assert bm.find_prefix_hits(d) == 1
    bm.allocate(d, 1)
    assert bm.block_ids(d.req_id) == [0, 3, 4, 5]  # never-keyed blocks come lowest id first
    for request in (c, d):
        bm.free(request.req_id)
    assert bm.ref_counts == [0] * 6 and bm.num_used_blocks == 0


def test_hit_requires_equal_stored_tokens() -> None:
    def colliding(parent: object, tokens: tuple[int, ...]) -> int:
        return 7  # every block gets the same key

    bm = KVCacheManager(8, BS, hasher=colliding)
    a = admit(bm, 0, [1, 2, 3, 4, 5])
    bm.publish(a, 5)
    b = Request(1, [9, 9, 9, 9, 5])
    assert bm.find_prefix_hits(b) == 0  # same key, different tokens: a miss, never wrong KV
    c = Request(2, [1, 2, 3, 4, 6])
    assert bm.find_prefix_hits(c) == 1


def test_duplicate_content_stays_private() -> None:
    bm = KVCacheManager(8, BS)
    tokens = [1, 2, 3, 4, 5]
    a = admit(bm, 0, tokens)
    b = admit(bm, 1, tokens)  # admitted before a's KV existed: no hit, own blocks
    assert bm.block_ids(a.req_id) == [0, 1] and bm.block_ids(b.req_id) == [2, 3]
    bm.publish(a, 5)
    bm.publish(b, 5)
    assert bm.take_events() == [BlocksStored((key(None, [1, 2, 3, 4]),), None, (1, 2, 3, 4), BS)]
    bm.free(b.req_id)
    assert bm.cached_free_blocks() == []  # block 2 was never keyed
    bm.free(a.req_id)
    assert bm.cached_free_blocks() == [0]


def test_reset_prefix_cache() -> None:
    bm = KVCacheManager(8, BS)
    a = admit(bm, 0, [1, 2, 3, 4, 5])
    bm.publish(a, 5)
    bm.free(a.req_id)
    bm.take_events()
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]
    assert bm.cached_free_blocks() == []
    assert bm.find_prefix_hits(Request(1, [1, 2, 3, 4, 5])) == 0
    assert bm.num_free_blocks == 8


def test_append_slots_and_truncate() -> None:
    bm = KVCacheManager(8, BS)
    a = admit(bm, 0, [1, 2, 3])
    assert bm.block_ids(a.req_id) == [0]
    assert bm.append_slots(a, 4) == []
    assert bm.can_grow(a.req_id, 32) and not bm.can_grow(a.req_id, 33)
    assert bm.append_slots(a, 9) == [1, 2]
    assert bm.truncate(a.req_id, 1) == [1, 2]
    assert bm.block_ids(a.req_id) == [0]
    assert bm.ref_counts[:3] == [1, 0, 0]
    with pytest.raises(ValueError, match="need 9 free blocks, only 7 left"):
        bm.append_slots(a, 40)
    bm.free(a.req_id)
    assert bm.num_used_blocks == 0


def test_prefix_caching_off() -> None:
    bm = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = admit(bm, 0, [1, 2, 3, 4, 5])
    bm.publish(a, 5)
    assert bm.take_events() == []
    assert bm.find_prefix_hits(Request(1, [1, 2, 3, 4, 5])) == 0
    bm.free(a.req_id)
    assert bm.cached_free_blocks() == []


def test_hit_requires_the_same_physical_parent() -> None:
    def ignores_parent(parent: object, tokens: tuple[int, ...]) -> int:
        return hash(tokens)  # a (bad) hasher without the chain

    bm = KVCacheManager(12, BS, hasher=ignores_parent)
    x = admit(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.publish(x, 9)
    y = admit(bm, 1, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    bm.publish(y, 9)
    assert bm.block_ids(x.req_id) == [0, 1, 2] and bm.block_ids(y.req_id) == [3, 4, 5]
    assert bm.lookup(hash((5, 6, 7, 8))) == 1  # y's second block stayed private
    # Block 1 has the right tokens and key but was computed after [1, 2, 3, 4], not [9, 9, 9, 9].
    w = Request(2, [9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.find_prefix_hits(w) == 1
    z = Request(3, [1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert bm.find_prefix_hits(z) == 2


def test_fast_event_constructor_builds_the_same_frozen_record() -> None:
    import dataclasses

    fast = BlocksStored.fast((1, 2), None, (3, 4), 2)
    assert fast == BlocksStored((1, 2), None, (3, 4), 2)
    assert hash(fast) == hash(BlocksStored((1, 2), None, (3, 4), 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.block_size = 3  # type: ignore[misc]
