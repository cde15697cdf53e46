"""Event records shaped like Baton's block-manager records (``baton_engine.prefix.events``).

The wire encoder reads records by attribute name, so tests use these stand-ins with the same
fields until both branches meet.
"""

from __future__ import annotations

from dataclasses import dataclass

BlockHash = int | bytes


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass
