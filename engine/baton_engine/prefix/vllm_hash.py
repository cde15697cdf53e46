"""vLLM-compatible prefix-block keys, so that an indexer computing vLLM keys from prompts (or
Baton's router reading a vLLM pod's events) finds the same blocks.

vLLM 0.32 (``--prefix-caching-hash-algo``, ``vllm/v1/core/kv_cache_utils.py``):

* a block's key is ``H((parent, tuple(token_ids), extra_keys))`` — a 32-byte digest; Baton has no
  extra keys (no LoRA, multimodal input or cache salt), so ``extra_keys`` is ``None``;
* ``H`` is ``sha256`` of the object's pickle (protocol 5; vLLM's default algorithm,
  `PREFIX_HASH_VLLM_SHA256`) or of its canonical CBOR (``sha256_cbor``, language-neutral,
  `PREFIX_HASH_VLLM`);
* block 0's parent is ``NONE_HASH = H(seed)``: the seed is ``PYTHONHASHSEED`` where set, else
  the fixed string ``"vllm-none-hash"`` (vLLM before 0.2x used random bytes then: set the seed
  explicitly to match those);
* KV events carry the digest's last 8 bytes as an unsigned big-endian int
  (`baton_engine.prefix.hashing.to_event_hash`).

Torch-free: the router computes the same keys from prompts.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Final

import cbor2

from baton_engine.contract import PREFIX_HASH_VLLM, PREFIX_HASH_VLLM_SHA256
from baton_engine.prefix.hashing import BlockHash

VLLM_PREFIX_HASHES: Final[tuple[str, ...]] = (PREFIX_HASH_VLLM_SHA256, PREFIX_HASH_VLLM)
"""The `contract.PREFIX_HASHES` this module implements."""
SEED_ENV: Final = "PYTHONHASHSEED"
#: vLLM's root seed when PYTHONHASHSEED is unset (cryptographic hash algorithms).
DEFAULT_SEED: Final = "vllm-none-hash"


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def sha256_pickle(value: object) -> bytes:
    """SHA-256 of the protocol-5 pickle of `value` (vLLM's ``sha256``)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


_DIGESTS: Final[dict[str, Callable[[object], bytes]]] = {
    PREFIX_HASH_VLLM: sha256_cbor,
    PREFIX_HASH_VLLM_SHA256: sha256_pickle,
}


def resolve_seed(seed: str | None = None) -> str:
    """The root seed: `seed` if given, else ``PYTHONHASHSEED`` if set (even empty), else vLLM's
    fixed default."""
    if seed is not None:
        return seed
    return os.environ.get(SEED_ENV, DEFAULT_SEED)


class VllmPrefixHasher:
    """A `PrefixHasher`: ``(parent_hash | None, token_ids) -> 32-byte digest``, as vLLM keys
    blocks with one of its cryptographic algorithms."""

    __slots__ = ("algorithm", "digest", "none_hash", "seed")

    def __init__(self, algorithm: str = PREFIX_HASH_VLLM, seed: str | None = None) -> None:
        """`seed` plays vLLM's root seed; None resolves it as vLLM does (`resolve_seed`)."""
        if algorithm not in _DIGESTS:
            raise ValueError(f"prefix hash: {algorithm!r} is not one of {', '.join(VLLM_PREFIX_HASHES)}")
        self.algorithm = algorithm
        self.digest = _DIGESTS[algorithm]
        self.seed = resolve_seed(seed)
        self.none_hash: bytes = self.digest(self.seed)

    def __call__(self, parent_hash: BlockHash | None, token_ids: tuple[int, ...], /) -> bytes:
        if parent_hash is not None and not isinstance(parent_hash, bytes):
            raise TypeError(
                f"{self.algorithm} parent hash must be the parent's 32-byte digest, got "
                f"{type(parent_hash).__name__}"
            )
        # vLLM tests `not parent`: an absent (or empty) parent means the sequence root.
        parent = parent_hash or self.none_hash
        return self.digest((parent, tuple(token_ids), None))


class VllmSha256CborHasher(VllmPrefixHasher):
    """`VllmPrefixHasher` with vLLM's ``sha256_cbor``."""

    __slots__ = ()

    def __init__(self, seed: str | None = None) -> None:
        super().__init__(PREFIX_HASH_VLLM, seed)

    @classmethod
    def from_environment(cls) -> VllmSha256CborHasher:
        """vLLM's seed rule: ``PYTHONHASHSEED`` if set, else its fixed default."""
        return cls(None)
