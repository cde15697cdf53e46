"""The KV-cache manager: the one owner of which blocks each request holds, and of the prefix cache.

* Blocks hold ``block_size`` tokens. The manager alone records each request's blocks, in order,
  and their chain keys; every call that gives blocks returns them (`KVCacheBlocks`, or the new
  ids), and the scheduler copies them into the batch's block table. Nothing else writes either.
* Prefix cache: a full block whose KV has been computed is *published* under its chain key
  (`prefix.hashing`); a later request with the same leading tokens shares it (ref count + 1). A
  hit is confirmed by comparing the stored token ids and the block's physical parent (the
  previous hit block, same allocation generation), so even a weak or colliding hasher can only
  cause a miss, never KV computed after a different prefix.
* The last block of a prompt is never served from the cache: the forward must compute at least
  one token to produce logits.
* Keys are published only after the forward that wrote the block's KV (`publish`), never at
  allocation, so a half-written block (chunked prefill, a block filled by decode) is never hit.
* Freed blocks with a key stay indexed in an LRU list ("lazy eviction"); taking one for new
  content evicts it (`BlocksRemoved`). A request frees its blocks tail first, so the tail of a
  request is evicted before its shareable head. Never-keyed free blocks (a min-heap by id) are
  used before any cached block is evicted.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from baton_engine.core.request import Request
from baton_engine.prefix.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVCacheEvent
from baton_engine.prefix.hashing import BlockHash, PrefixHasher, fast_prefix_hash, parent_and_tokens_packer

_NO_PARENT = (-1, 0)


@dataclass(frozen=True)
class KVCacheBlocks:
    """The blocks one `KVCacheManager.allocate` gave a request: its whole block table."""

    block_ids: list[int]
    """Block ids in table order: the prefix-cache hits first, then fresh blocks."""
    num_hit_blocks: int = 0
    """How many leading `block_ids` are prefix-cache hits (their KV is already computed)."""


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager keeps per request (from its first allocation until `free`)."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockHash] = field(default_factory=list)
    """Chain keys of the leading full blocks of the request's tokens, computed lazily; kept when
    a preemption frees the blocks (the tokens do not change)."""
    num_published: int = 0
    """Leading blocks whose KV is computed and whose key has been published (or hit)."""


class KVCacheManager:
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
        self._requests: dict[int, _RequestBlocks] = {}
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
        """Fraction of blocks referenced by a live request (cached free blocks count as free)."""
        return self._num_used / self.num_blocks

    def cached_free_blocks(self) -> list[int]:
        """Free blocks still holding cached KV, in eviction order (next victim first)."""
        return list(self._cached_free)

    def lookup(self, key: BlockHash) -> int | None:
        """The block published under `key`, if any."""
        return self._index.get(key)

    def block_ids(self, req_id: int) -> list[int]:
        """A copy of request `req_id`'s blocks in table order ([] if it holds none)."""
        record = self._requests.get(req_id)
        return [] if record is None else list(record.block_ids)

    def num_blocks_of(self, req_id: int) -> int:
        record = self._requests.get(req_id)
        return 0 if record is None else len(record.block_ids)

    def block_keys_of(self, req_id: int) -> list[BlockHash]:
        """A copy of the chain keys computed so far for request `req_id`'s full blocks."""
        record = self._requests.get(req_id)
        return [] if record is None else list(record.keys)

    def num_published_blocks(self, req_id: int) -> int:
        record = self._requests.get(req_id)
        return 0 if record is None else record.num_published

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the events recorded since the last call (once per engine step)."""
        events, self._events = self._events, []
        return events

    # -- hashing ----------------------------------------------------------------------------
    def _record(self, request: Request) -> _RequestBlocks:
        record = self._requests.get(request.req_id)
        if record is None:
            record = self._requests[request.req_id] = _RequestBlocks()
        return record

    def _ensure_keys(self, record: _RequestBlocks, tokens: list[int], num_blocks: int) -> list[BlockHash]:
        keys = record.keys
        bs = self.block_size
        parent = keys[-1] if keys else None
        for i in range(len(keys), num_blocks):
            parent = self.hasher(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(parent)
        return keys

    def _match_prefix(self, request: Request) -> list[int]:
        """Published blocks matching the request's leading tokens, last token's block excluded."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_hits = (request.num_tokens - 1) // bs
        if max_hits <= 0:
            return []
        record = self._record(request)
        hits: list[int] = []
        tokens = request.token_ids
        parent = _NO_PARENT
        for i in range(max_hits):
            key = self._ensure_keys(record, tokens, i + 1)[i]
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

    def _parent_link(self, block_ids: list[int], index: int) -> tuple[int, int]:
        if index == 0:
            return _NO_PARENT
        parent = block_ids[index - 1]
        return (parent, self.block_generation[parent])

    # -- allocation -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hits(self, request: Request) -> int | None:
        """Prefix-hit blocks (>= 0) if the whole request fits now, else None. Claims nothing."""
        hits = self._match_prefix(request)
        hits_now_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        new_blocks = self.blocks_needed(request.num_tokens) - len(hits)
        if new_blocks > self.num_free_blocks - hits_now_free:
            return None
        return len(hits)

    def allocate(self, request: Request, num_hit_blocks: int) -> KVCacheBlocks:
        """Blocks for all of `request`'s tokens, the first `num_hit_blocks` from the prefix cache.

        Call `find_prefix_hits` first (in the same step, with nothing in between)."""
        record = self._record(request)
        if record.block_ids:
            raise ValueError(f"request {request.req_id} already has blocks")
        hits = self._match_prefix(request)[:num_hit_blocks]
        if len(hits) != num_hit_blocks:
            raise ValueError(f"request {request.req_id}: prefix hit changed since find_prefix_hits")
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self._cached_free[block_id]
                self._num_used += 1
            self.ref_counts[block_id] += 1
        record.block_ids.extend(hits)
        record.block_ids.extend(self._take(self.blocks_needed(request.num_tokens) - len(hits)))
        record.num_published = len(hits)
        return KVCacheBlocks(list(record.block_ids), len(hits))

    def _take(self, count: int) -> list[int]:
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

    def can_grow(self, req_id: int, num_tokens: int) -> bool:
        """Whether request `req_id` can grow to hold `num_tokens` tokens (e.g. computed + 1 + K
        drafts) with the blocks free now."""
        return self.blocks_needed(num_tokens) - self.num_blocks_of(req_id) <= self.num_free_blocks

    def append_slots(self, request: Request, num_tokens: int) -> list[int]:
        """Grow `request`'s blocks to hold `num_tokens` tokens; returns the new block ids."""
        record = self._record(request)
        missing = self.blocks_needed(num_tokens) - len(record.block_ids)
        if missing <= 0:
            return []
        new_blocks = self._take(missing)
        record.block_ids.extend(new_blocks)
        return new_blocks

    def append_one_block_each(self, req_ids: Sequence[int]) -> list[int]:
        """One fresh block appended to each of `req_ids` (the decode path's common case);
        returns them in the same order."""
        new_blocks = self._take(len(req_ids))
        records = self._requests
        for req_id, block_id in zip(req_ids, new_blocks, strict=True):
            records[req_id].block_ids.append(block_id)
        return new_blocks

    def truncate(self, req_id: int, num_blocks: int) -> list[int]:
        """Give back blocks past the first `num_blocks` (unused speculative slots); returns them."""
        record = self._requests[req_id]
        if num_blocks < record.num_published:
            raise ValueError("cannot truncate published blocks")
        dropped = record.block_ids[num_blocks:]
        del record.block_ids[num_blocks:]
        self._release(reversed(dropped))
        return dropped

    def free(self, req_id: int, *, keep_keys: bool = False) -> None:
        """Release all of request `req_id`'s blocks, tail first (so tails are evicted before
        heads), and forget it — unless `keep_keys` (a preemption: the request comes back with the
        same tokens, so its chain keys stay valid)."""
        record = self._requests.get(req_id)
        if record is None:
            return
        self._release(reversed(record.block_ids))
        record.block_ids.clear()
        record.num_published = 0
        if not keep_keys:
            del self._requests[req_id]

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
    def publish(self, request: Request, num_computed_tokens: int) -> None:
        """Make the full blocks within `request`'s first `num_computed_tokens` tokens hittable.

        Call after the forward that wrote their KV. A block whose key is already published by
        another block (two identical prompts computed at once) stays private.
        """
        if not self.enable_prefix_caching:
            return
        record = self._requests.get(request.req_id)
        if record is None:
            return
        bs = self.block_size
        block_ids = record.block_ids
        num_full = min(num_computed_tokens // bs, len(block_ids))
        start = record.num_published
        if num_full <= start:
            return
        tokens = request.token_ids
        keys = self._ensure_keys(record, tokens, num_full)
        index = self._index
        run_start = -1
        for i in range(start, num_full):
            key = keys[i]
            if key in index:
                if run_start >= 0:
                    self._record_stored(keys, tokens, run_start, i)
                    run_start = -1
                continue
            block_id = block_ids[i]
            index[key] = block_id
            self.block_keys[block_id] = key
            self.block_tokens[block_id] = tuple(tokens[i * bs : (i + 1) * bs])
            self.block_parent[block_id] = self._parent_link(block_ids, i)
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._record_stored(keys, tokens, run_start, num_full)
        record.num_published = num_full

    def publish_next_block(self, requests: list[Request], num_computed_tokens: list[int]) -> None:
        """`publish` for requests whose KV just filled exactly one more block (the decode path:
        one call per step for every row that crossed a block boundary); `num_computed_tokens`
        aligned with `requests`."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        index = self._index
        records = self._requests
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
        for request, computed in zip(requests, num_computed_tokens, strict=True):
            record = records[request.req_id]
            i = record.num_published
            keys = record.keys
            if len(keys) != i:  # keys already computed ahead (e.g. after a preemption)
                self.publish(request, computed)
                continue
            parent = keys[i - 1] if i else None
            block_token_ids = tuple(request.token_ids[i * bs : (i + 1) * bs])
            key: BlockHash
            if inline_default and type(parent) is int:
                key = from_bytes(blake2b(pack(parent, *block_token_ids), digest_size=8).digest(), "little")
            else:
                key = hasher(parent, block_token_ids)
            keys.append(key)
            record.num_published = i + 1
            if key in index:
                continue
            block_ids = record.block_ids
            block_id = block_ids[i]
            index[key] = block_id
            block_keys[block_id] = key
            block_tokens[block_id] = block_token_ids
            if i:
                parent_id = block_ids[i - 1]
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
