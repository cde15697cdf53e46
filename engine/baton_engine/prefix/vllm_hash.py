"""vLLM-compatible prefix-block keys (``--prefix-hash vllm-sha256-cbor``, `contract.PREFIX_HASH_VLLM`).

Reproduces vLLM v0.22.0's ``sha256_cbor`` block hashing so that an indexer computing vLLM keys
from prompts finds Baton's blocks:

* a block's key is ``sha256(cbor2.dumps((parent, tuple(token_ids), extra_keys),
  canonical=True))`` — a 32-byte digest; Baton has no extra keys (no LoRA, multimodal input
  or cache salt), so ``extra_keys`` is ``None``;
* block 0's parent is ``NONE_HASH = sha256(cbor2.dumps(seed, canonical=True))`` where ``seed``
  is the ``PYTHONHASHSEED`` string; with ``PYTHONHASHSEED`` unset vLLM picks 32 random bytes per
  process, and so does `VllmSha256CborHasher.from_environment` (keys then match nobody: set the
  same seed on every engine and the router);
* KV events carry the digest's last 8 bytes as an unsigned big-endian int
  (`baton_engine.prefix.hashing.to_event_hash`).

Torch-free: the router computes the same keys from prompts.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Final

import cbor2

SEED_ENV: Final = "PYTHONHASHSEED"

logger = logging.getLogger(__name__)


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value`."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class VllmSha256CborHasher:
    """A `PrefixHasher`: ``(parent_hash | None, token_ids) -> 32-byte digest``."""

    __slots__ = ("none_hash", "seed")

    def __init__(self, seed: str | None) -> None:
        """`seed` plays vLLM's ``PYTHONHASHSEED``; None means a random per-process root."""
        self.seed = seed
        self.none_hash: bytes = os.urandom(32) if seed is None else sha256_cbor(seed)

    @classmethod
    def from_environment(cls) -> VllmSha256CborHasher:
        """vLLM's seed rule: ``PYTHONHASHSEED`` if set (even empty), else random."""
        seed = os.environ.get(SEED_ENV)
        if seed is None:
            logger.warning(
                "%s is not set: vllm-sha256-cbor block keys are random per process and will not "
                "match other engines or the router; set the same %s everywhere",
                SEED_ENV,
                SEED_ENV,
            )
        return cls(seed)

    def __call__(self, parent_hash: int | bytes | None, token_ids: tuple[int, ...], /) -> bytes:
        if parent_hash is not None and not isinstance(parent_hash, bytes):
            raise TypeError(
                f"vllm-sha256-cbor parent hash must be the parent's 32-byte digest, got "
                f"{type(parent_hash).__name__}"
            )
        # vLLM tests `not parent`: an absent (or empty) parent means the sequence root.
        parent = parent_hash or self.none_hash
        return sha256_cbor((parent, tuple(token_ids), None))
