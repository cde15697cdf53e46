"""A prompt's block keys, computed exactly as the engines compute the keys their KV events carry.

Each full block's hash chains its parent's hash and its token ids; events carry the 64-bit form
(``kv_events_wire.to_event_hash``). The chain function itself is the engines' choice of
``--prefix-hash``; the router must be started with the same choice (and, for the ``vllm-*``
hashes, the same ``--prefix-hash-seed`` or ``PYTHONHASHSEED``; by default both sides use vLLM's
fixed root, which is also what vLLM pods use).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baton_engine.kv_events_wire import to_event_hash
from baton_engine.prefix_hash import fast_prefix_hash
from baton_engine.prefix_hash_vllm import VLLM_PREFIX_HASHES, VllmPrefixHasher

BlockHash = int | bytes
#: ``(parent block hash or None for the first block, the block's token ids) -> block hash``.
ChainHash = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]

PREFIX_HASH_NONE = "none"
PREFIX_HASH_FAST = "fast"  # the engines' default (EngineConfig.prefix_hash)
#: --prefix-hash choices the router can compute.
PREFIX_HASHES: tuple[str, ...] = (PREFIX_HASH_NONE, PREFIX_HASH_FAST, *VLLM_PREFIX_HASHES)


class ChainedBlockHasher:
    """A ``prefix.BlockHasher``: event keys of every full block of a prompt."""

    def __init__(self, chain: ChainHash, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.chain = chain
        self.block_size = block_size

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        keys: list[int] = []
        parent: BlockHash | None = None
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = self.chain(parent, tuple(token_ids[start : start + size]))
            keys.append(to_event_hash(parent))
        return keys


def block_hasher(prefix_hash: str, block_size: int, seed: str | None = None) -> ChainedBlockHasher | None:
    """The hasher for an engine ``--prefix-hash`` value (and seed of the vllm-* ones); None for
    "none" (routing by load only)."""
    if prefix_hash == PREFIX_HASH_NONE:
        return None
    if prefix_hash == PREFIX_HASH_FAST:
        return ChainedBlockHasher(fast_prefix_hash, block_size)
    if prefix_hash in VLLM_PREFIX_HASHES:
        return ChainedBlockHasher(VllmPrefixHasher(prefix_hash, seed), block_size)
    raise ValueError(f"prefix hash: {prefix_hash!r} is not one of {', '.join(PREFIX_HASHES)}")
