"""Prefix-block hashing: the key of a full KV block is a hash chained over its parent's key.

A `PrefixHasher` is any callable ``(parent_hash, token_ids) -> BlockHash``:

* ``parent_hash`` is the key of the previous block of the same sequence, or None for block 0;
* ``token_ids`` are exactly ``block_size`` token ids of this block;
* the result must be deterministic across processes and machines (the router and KV-event
  indexers recompute it from prompts), and equal inputs must give equal keys.

Keys are only an index: the block manager compares stored token ids on every hit, so a
collision costs a miss, never wrong KV. The default is `fast_prefix_hash` (64-bit BLAKE2b); a
vLLM-compatible sha256-cbor hasher implementing the same protocol lives in its own module.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

BlockHash = int | bytes
"""A block's key: an int (default hasher) or bytes (digest-style hashers)."""


class PrefixHasher(Protocol):
    def __call__(self, parent_hash: BlockHash | None, token_ids: tuple[int, ...], /) -> BlockHash:
        """Key of a block holding `token_ids` whose previous block has key `parent_hash`."""
        ...


_PACKERS: dict[int, struct.Struct] = {}


def _packer(num_tokens: int, with_parent: bool) -> struct.Struct:
    key = num_tokens * 2 + with_parent
    packer = _PACKERS.get(key)
    if packer is None:
        packer = _PACKERS[key] = struct.Struct(("<Q" if with_parent else "<") + f"{num_tokens}q")
    return packer


def parent_and_tokens_packer(num_tokens: int) -> struct.Struct:
    """The packer `fast_prefix_hash` uses for an int parent and `num_tokens` tokens."""
    return _packer(num_tokens, True)


def fast_prefix_hash(parent_hash: BlockHash | None, token_ids: tuple[int, ...], /) -> int:
    """Unsigned 64-bit BLAKE2b of ``parent (u64 LE, absent for block 0) || tokens (int64 LE)``.

    Stable across Python versions and platforms (unlike the built-in `hash`), stdlib only.
    A bytes parent (from another hasher) is folded in as its own bytes.
    """
    if parent_hash is None:
        data = _packer(len(token_ids), False).pack(*token_ids)
    elif isinstance(parent_hash, int):
        data = _packer(len(token_ids), True).pack(parent_hash, *token_ids)
    else:
        data = parent_hash + _packer(len(token_ids), False).pack(*token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain_hashes(
    hasher: PrefixHasher, token_ids: list[int] | tuple[int, ...], block_size: int
) -> list[BlockHash]:
    """Keys of every full block of `token_ids` (a partial last block has no key)."""
    keys: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, tuple(token_ids[start : start + block_size]))
        keys.append(parent)
    return keys
