"""Baton's internal KV-cache event records, drained from the KV-cache manager once per step.

These are plain frozen records; the wire encoding (vLLM's msgpack format) lives in its own
module. Block hashes are whatever the configured `PrefixHasher` returns (int or bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine.prefix.hashing import BlockHash


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive full blocks of one request became hittable (their KV is computed)."""

    block_hashes: tuple[BlockHash, ...]
    """The blocks' chain keys, in order."""
    parent_block_hash: BlockHash | None
    """Key of the block before the first one here; None when the run starts the request."""
    token_ids: tuple[int, ...]
    """The tokens of all blocks in `block_hashes`, concatenated (``len == block_size * n``)."""
    block_size: int
    """Tokens per block."""

    @classmethod
    def fast(
        cls,
        block_hashes: tuple[BlockHash, ...],
        parent_block_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        block_size: int,
    ) -> BlocksStored:
        """Same as the constructor, about twice as fast (the decode path records one event per
        block boundary crossed; the generated frozen `__init__` is the slow part)."""
        event = object.__new__(cls)
        fields = event.__dict__
        fields["block_hashes"] = block_hashes
        fields["parent_block_hash"] = parent_block_hash
        fields["token_ids"] = token_ids
        fields["block_size"] = block_size
        return event


@dataclass(frozen=True)
class BlocksRemoved:
    """Cached blocks were evicted (their storage reused for other content)."""

    block_hashes: tuple[BlockHash, ...]
    """The evicted blocks' keys."""


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no earlier hash is hittable any more."""


KVCacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared
