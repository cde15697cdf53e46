"""Paged KV-cache blocks: allocation, reference counts, and the prefix cache.

* Blocks hold ``block_size`` tokens. A sequence's `block_table` lists its blocks in order.
* Prefix cache: a full block whose KV has been computed is *published* under its chain key
  (`prefix_hash`); a later sequence with the same leading tokens shares it (ref count + 1). A hit
  is confirmed by comparing the stored token ids and the block's physical parent (the previous
  hit block, same allocation generation), so even a weak or colliding hasher can only cause a
  miss, never KV computed after a different prefix.
* The last block of a prompt is never served from the cache: the forward must compute at least
  one token to produce logits.
* Keys are published only after the forward that wrote the block's KV (`publish`), never at
  allocation, so a half-written block (chunked prefill, a block filled by decode) is never hit.
* Freed blocks with a key stay indexed in an LRU list ("lazy eviction"); taking one for new
  content evicts it (`BlocksRemoved`). A sequence frees its blocks tail first, so the tail of a
  request is evicted before its shareable head. Never-keyed free blocks (a min-heap by id) are
  used before any cached block is evicted.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterable

from baton_engine.core.request import Request
from baton_engine.prefix.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVCacheEvent
from baton_engine.prefix.hashing import BlockHash, PrefixHasher, fast_prefix_hash, parent_and_tokens_packer

_NO_PARENT = (-1, 0)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        hasher: PrefixHasher = fast_prefix_hash,
        record_events: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self.record_events = record_events
        """Keep KV events for `take_events` (off when nobody publishes them)."""
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_keys: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_generation: list[int] = [0] * num_blocks
        """Bumped each time a block is taken for new content."""
        self.block_parent: list[tuple[int, int]] = [_NO_PARENT] * num_blocks
        """(previous block id, its generation) when the block was published; block 0: (-1, 0)."""
        self._index: dict[BlockHash, int] = {}
        self._vacant: list[int] = list(range(num_blocks))  # already a valid min-heap
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._num_used = 0
        self._events: list[KVCacheEvent] = []

    # -- inspection -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._vacant) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached free blocks count as free)."""
        return self._num_used / self.num_blocks

    def cached_free_blocks(self) -> list[int]:
        """Free blocks still holding cached KV, in eviction order (next victim first)."""
        return list(self._cached_free)

    def lookup(self, key: BlockHash) -> int | None:
        """The block published under `key`, if any."""
        return self._index.get(key)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the events recorded since the last call (once per engine step)."""
        events, self._events = self._events, []
        return events

    # -- hashing ----------------------------------------------------------------------------
    def _ensure_keys(self, seq: Request, num_blocks: int) -> list[BlockHash]:
        keys = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        parent = keys[-1] if keys else None
        for i in range(len(keys), num_blocks):
            parent = self.hasher(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(parent)
        return keys

    def _match_prefix(self, seq: Request) -> list[int]:
        """Published blocks matching the sequence's leading tokens, last token's block excluded."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_hits = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        tokens = seq.token_ids
        parent = _NO_PARENT
        for i in range(max_hits):
            key = self._ensure_keys(seq, i + 1)[i]
            block_id = self._index.get(key)
            if (
                block_id is None
                or self.block_parent[block_id] != parent
                or self.block_tokens[block_id] != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block_id)
            parent = (block_id, self.block_generation[block_id])
        return hits

    def _parent_link(self, seq: Request, index: int) -> tuple[int, int]:
        if index == 0:
            return _NO_PARENT
        parent = seq.block_table[index - 1]
        return (parent, self.block_generation[parent])

    # -- allocation -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Request) -> int:
        """Prefix-hit blocks (>= 0) if the whole sequence fits now, else -1. Claims nothing."""
        hits = self._match_prefix(seq)
        hits_now_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        new_blocks = self.blocks_needed(seq.num_tokens) - len(hits)
        if new_blocks > self.num_free_blocks - hits_now_free:
            return -1
        return len(hits)

    def allocate(self, seq: Request, num_hit_blocks: int) -> None:
        """Give `seq` blocks for all its tokens: the first `num_hit_blocks` from the prefix cache.

        Sets `num_cached_tokens` and `num_computed_tokens` to the hit length. Call
        `can_allocate` first (in the same step, with nothing in between).
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        hits = self._match_prefix(seq)[:num_hit_blocks]
        if len(hits) != num_hit_blocks:
            raise ValueError(f"sequence {seq.seq_id}: prefix hit changed since can_allocate")
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self._cached_free[block_id]
                self._num_used += 1
            self.ref_counts[block_id] += 1
        seq.block_table.extend(hits)
        seq.block_table.extend(self.take_blocks(self.blocks_needed(seq.num_tokens) - len(hits)))
        seq.num_published_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = len(hits) * self.block_size

    def take_blocks(self, count: int) -> list[int]:
        """`count` fresh blocks (ref count 1), evicting least recently freed cached blocks."""
        if count > self.num_free_blocks:
            raise ValueError(f"need {count} free blocks, only {self.num_free_blocks} left")
        taken: list[int] = []
        for _ in range(count):
            if self._vacant:
                block_id = heapq.heappop(self._vacant)
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._evict(block_id)
            self.ref_counts[block_id] = 1
            self.block_generation[block_id] += 1
            taken.append(block_id)
        self._num_used += count
        return taken

    def can_append(self, seq: Request, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` tokens (e.g. computed + 1 + K drafts)."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Request, num_tokens: int) -> list[int]:
        """Grow `seq.block_table` to hold `num_tokens` tokens; returns the new block ids."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return []
        new_blocks = self.take_blocks(missing)
        seq.block_table.extend(new_blocks)
        return new_blocks

    def truncate(self, seq: Request, num_blocks: int) -> list[int]:
        """Give back blocks past the first `num_blocks` (unused speculative slots); returns them."""
        if num_blocks < seq.num_published_blocks:
            raise ValueError("cannot truncate published blocks")
        dropped = seq.block_table[num_blocks:]
        del seq.block_table[num_blocks:]
        self._release(reversed(dropped))
        return dropped

    def free(self, seq: Request) -> None:
        """Release all of `seq`'s blocks, tail first (so tails are evicted before heads)."""
        self._release(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_published_blocks = 0

    def _release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self.ref_counts[block_id] = count
            if count == 0:
                self._num_used -= 1
                if self.block_keys[block_id] is not None:
                    self._cached_free[block_id] = None
                else:
                    heapq.heappush(self._vacant, block_id)

    def _evict(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is not None:
            if self._index.get(key) == block_id:
                del self._index[key]
            if self.record_events:
                self._events.append(BlocksRemoved((key,)))
            self.block_keys[block_id] = None
            self.block_tokens[block_id] = None

    # -- publishing -------------------------------------------------------------------------
    def publish(self, seq: Request, num_computed_tokens: int) -> None:
        """Make the full blocks within the first `num_computed_tokens` tokens hittable.

        Call after the forward that wrote their KV. A block whose key is already published by
        another block (two identical prompts computed at once) stays private.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(seq.block_table))
        start = seq.num_published_blocks
        if num_full <= start:
            return
        keys = self._ensure_keys(seq, num_full)
        tokens = seq.token_ids
        index = self._index
        run_start = -1
        for i in range(start, num_full):
            key = keys[i]
            if key in index:
                if run_start >= 0:
                    self._record_stored(keys, tokens, run_start, i)
                    run_start = -1
                continue
            block_id = seq.block_table[i]
            index[key] = block_id
            self.block_keys[block_id] = key
            self.block_tokens[block_id] = tuple(tokens[i * bs : (i + 1) * bs])
            self.block_parent[block_id] = self._parent_link(seq, i)
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._record_stored(keys, tokens, run_start, num_full)
        seq.num_published_blocks = num_full

    def publish_next_block(self, seqs: list[Request]) -> None:
        """`publish` for sequences whose KV just filled exactly one more block (the decode
        path: one call per step for every row that crossed a block boundary)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        index = self._index
        hasher = self.hasher
        block_keys = self.block_keys
        block_tokens = self.block_tokens
        block_parent = self.block_parent
        generation = self.block_generation
        events = self._events if self.record_events else None
        make_event = BlocksStored.fast
        # The default hasher, inlined (same bytes as `fast_prefix_hash`, minus two calls).
        inline_default = hasher is fast_prefix_hash
        pack = parent_and_tokens_packer(bs).pack
        blake2b = hashlib.blake2b
        from_bytes = int.from_bytes
        for seq in seqs:
            i = seq.num_published_blocks
            keys = seq.block_hashes
            if len(keys) != i:  # keys already computed ahead (e.g. after a preemption)
                self.publish(seq, seq.num_computed_tokens)
                continue
            parent = keys[i - 1] if i else None
            block_token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key: BlockHash
            if inline_default and type(parent) is int:
                key = from_bytes(blake2b(pack(parent, *block_token_ids), digest_size=8).digest(), "little")
            else:
                key = hasher(parent, block_token_ids)
            keys.append(key)
            seq.num_published_blocks = i + 1
            if key in index:
                continue
            block_id = seq.block_table[i]
            index[key] = block_id
            block_keys[block_id] = key
            block_tokens[block_id] = block_token_ids
            if i:
                parent_id = seq.block_table[i - 1]
                block_parent[block_id] = (parent_id, generation[parent_id])
            else:
                block_parent[block_id] = _NO_PARENT
            if events is not None:
                events.append(make_event((key,), parent, block_token_ids, bs))

    def _record_stored(self, keys: list[BlockHash], tokens: list[int], first: int, end: int) -> None:
        if not self.record_events:
            return
        bs = self.block_size
        self._events.append(
            BlocksStored(
                block_hashes=tuple(keys[first:end]),
                parent_block_hash=keys[first - 1] if first > 0 else None,
                token_ids=tuple(tokens[first * bs : end * bs]),
                block_size=bs,
            )
        )

    def reset_prefix_cache(self) -> None:
        """Forget every published key (live blocks keep their KV but are no longer hittable)."""
        for block_id in self._cached_free:
            heapq.heappush(self._vacant, block_id)
        self._cached_free.clear()
        for key, block_id in self._index.items():
            if self.block_keys[block_id] == key:
                self.block_keys[block_id] = None
                self.block_tokens[block_id] = None
        self._index.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
