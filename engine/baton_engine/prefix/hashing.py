"""Prefix-block keys: the one registry of block-key hash algorithms, shared by engine and router.

The key of a full KV block is a hash chained over its parent's key. A `PrefixHasher` is any
callable ``(parent_hash, token_ids) -> BlockHash``:

* ``parent_hash`` is the key of the previous block of the same request, or None for block 0;
* ``token_ids`` are exactly ``block_size`` token ids of this block;
* the result must be deterministic across processes and machines (the router and KV-event
  indexers recompute it from prompts), and equal inputs must give equal keys.

Keys are only an index: the KV-cache manager compares stored token ids on every hit, so a
collision costs a miss, never wrong KV. The algorithms, by their ``--prefix-hash`` name
(`contract.PREFIX_HASHES`), are built by `prefix_hasher`: ``fast`` (`fast_prefix_hash`, 64-bit
BLAKE2b, the default), ``vllm-sha256`` and ``vllm-sha256-cbor`` (`vllm_hash.VllmPrefixHasher`:
vLLM's keys, rooted in a seed).
KV events carry every key in its 64-bit form (`to_event_hash`); `EventKeyHasher` computes those
for a prompt, as the router does to score pods.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final, Protocol

from baton_engine import contract

BlockHash = int | bytes
"""A block's key: an int (``fast``) or bytes (digest-style hashers such as ``vllm-sha256-cbor``)."""

_UINT64_MASK: Final = (1 << 64) - 1


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


def chain_hashes(hasher: PrefixHasher, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Keys of every full block of `token_ids` (a partial last block has no key)."""
    keys: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, tuple(token_ids[start : start + block_size]))
        keys.append(parent)
    return keys


def to_event_hash(block_hash: BlockHash) -> int:
    """The 64-bit form of a block key that KV events carry (vLLM's int conversion).

    Digests (bytes) keep their last 8 bytes, read big-endian. Int keys (``fast``) must already fit
    in an unsigned 64-bit int. Raises ValueError for anything else.
    """
    if isinstance(block_hash, bytes | bytearray):
        if not block_hash:
            raise ValueError("block hash is empty bytes")
        return int.from_bytes(block_hash, "big") & _UINT64_MASK
    if isinstance(block_hash, bool) or not isinstance(block_hash, int):
        raise ValueError(f"block hash must be int or bytes, got {type(block_hash).__name__}")
    if not 0 <= block_hash <= _UINT64_MASK:
        raise ValueError(f"int block hash {block_hash} is outside the unsigned 64-bit range")
    return block_hash


def prefix_hasher(name: str, seed: str | None = None) -> PrefixHasher:
    """The block-key algorithm called `name` (a `contract.PREFIX_HASHES` value: the engines' and
    the router's ``--prefix-hash``). The ``vllm-*`` ones are rooted in `seed`
    (``--prefix-hash-seed``); None resolves it as vLLM does (`vllm_hash.resolve_seed`)."""
    if name == contract.PREFIX_HASH_FAST:
        return fast_prefix_hash
    if name in (contract.PREFIX_HASH_VLLM, contract.PREFIX_HASH_VLLM_SHA256):
        from baton_engine.prefix.vllm_hash import VllmPrefixHasher

        return VllmPrefixHasher(name, seed)
    raise ValueError(f"prefix hash: {name!r} is not one of {', '.join(contract.PREFIX_HASHES)}")


class EventKeyHasher:
    """The KV-event keys (`to_event_hash` of each chained key) of every full block of a prompt:
    what the engines publish for it, recomputed from its token ids (the router's view)."""

    def __init__(self, hasher: PrefixHasher, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.hasher = hasher
        self.block_size = block_size

    @classmethod
    def named(cls, name: str, block_size: int, seed: str | None = None) -> EventKeyHasher:
        """For the engines' ``--prefix-hash`` value and seed (see `prefix_hasher`)."""
        return cls(prefix_hasher(name, seed), block_size)

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        return [to_event_hash(key) for key in chain_hashes(self.hasher, token_ids, self.block_size)]
