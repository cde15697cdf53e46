"""Seams for prefix-aware routing: the request's token ids, their block hashes, and the KV-event
index that knows which pod caches which blocks.

The router needs the same token ids, block size and block hash as the engines. Those come from
other parts of Baton (the torch-free tokenizer, the engines' hash, the KV-event subscriber); the
router only depends on the protocols below, so any of them can be left out, in which case every
pod scores zero cached blocks and routing falls back to load alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from baton_engine import contract
from baton_engine.prefix.hashing import EventKeyHasher
from baton_engine.router.endpoints import Endpoint

log = logging.getLogger(__name__)

Api = Literal["completions", "chat"]

PREFIX_HASH_NONE = "none"
"""``--prefix-hash none``: compute no block keys, route by load only."""
PREFIX_HASHES: tuple[str, ...] = (PREFIX_HASH_NONE, *contract.PREFIX_HASHES)
"""What the router's ``--prefix-hash`` (and a pod's hashing annotation) may name."""


def block_hasher(prefix_hash: str, block_size: int, seed: str | None = None) -> EventKeyHasher | None:
    """The event keys of a pod hashing with `prefix_hash` (and `seed`, for the vllm-* ones); None
    for ``none`` (that pod is routed by load only)."""
    if prefix_hash == PREFIX_HASH_NONE:
        return None
    return EventKeyHasher.named(prefix_hash, block_size, seed)


class RequestTokenizer(Protocol):
    """The prompt token ids an engine would compute for an OpenAI request body."""

    def prompt_token_ids(self, api: Api, body: Mapping[str, Any]) -> list[int]: ...


class BlockHasher(Protocol):
    """One hash per full block of ``token_ids``, chained exactly as the engines chain them."""

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]: ...


class PrefixMatcher(Protocol):
    """The KV-event index's view: pod -> number of leading ``block_hashes`` it caches."""

    def longest_prefix_match(self, block_hashes: Sequence[int]) -> Mapping[str, int]: ...


def literal_token_ids(api: Api, body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids needs no tokenizer."""
    if api != "completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None


#: ``(prefix hash name, block size, seed) -> hasher`` (None: that pod is routed by load only).
HasherFactory = Callable[[str, int, str | None], BlockHasher | None]


class PrefixScorer:
    """Cached prompt blocks per candidate endpoint for one request.

    Endpoints that declare their own hashing (`Endpoint.block_size` / `prefix_hash`, from pod
    annotations) are scored with `hasher_factory`'s hasher for it; the others with `hasher`.
    During a block-size rollout the two generations of pods thus each get their own keys."""

    def __init__(
        self,
        *,
        tokenizer: RequestTokenizer | None = None,
        hasher: BlockHasher | None = None,
        index: PrefixMatcher | None = None,
        hasher_factory: HasherFactory | None = None,
        default_prefix_hash: str = "none",
        default_block_size: int = 16,
        default_seed: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.index = index
        self.hasher_factory = hasher_factory
        self.default_prefix_hash = default_prefix_hash
        self.default_block_size = default_block_size
        self.default_seed = default_seed
        self._hashers: dict[tuple[str, int, str | None], BlockHasher | None] = {}

    def hasher_for(self, endpoint: Endpoint) -> BlockHasher | None:
        """The hasher of the endpoint's own settings, or the scorer's default one."""
        own = (endpoint.block_size, endpoint.prefix_hash, endpoint.prefix_hash_seed)
        if self.hasher_factory is None or own == (None, None, None):
            return self.hasher
        settings = (
            endpoint.prefix_hash or self.default_prefix_hash,
            endpoint.block_size or self.default_block_size,
            endpoint.prefix_hash_seed or self.default_seed,
        )
        if settings not in self._hashers:
            self._hashers[settings] = self.hasher_factory(*settings)
        return self._hashers[settings]

    def token_ids(self, api: Api, body: Mapping[str, Any]) -> list[int] | None:
        ids = literal_token_ids(api, body)
        if ids is not None or self.tokenizer is None:
            return ids
        try:
            return self.tokenizer.prompt_token_ids(api, body)
        except Exception as exc:  # the engine reports bad input to the client; routing just goes blind
            log.debug("tokenizer failed, routing by load only: %s", exc)
            return None

    def matched_blocks(
        self, api: Api, body: Mapping[str, Any], endpoints: Sequence[Endpoint]
    ) -> dict[str, int]:
        """Endpoint key -> cached leading blocks (endpoints the index does not know are absent)."""
        if self.index is None or not endpoints:
            return {}
        groups: dict[int, tuple[BlockHasher, list[Endpoint]]] = {}
        for endpoint in endpoints:
            hasher = self.hasher_for(endpoint)
            if hasher is not None:
                groups.setdefault(id(hasher), (hasher, []))[1].append(endpoint)
        if not groups:
            return {}
        ids = self.token_ids(api, body)
        if not ids:
            return {}
        scores: dict[str, int] = {}
        for hasher, members in groups.values():
            hashes = hasher.block_hashes(ids)
            matches = self.index.longest_prefix_match(hashes) if hashes else {}
            for endpoint in members:
                aliases = endpoint.aliases()
                best = max((blocks for pod, blocks in matches.items() if pod in aliases), default=0)
                if best:
                    scores[endpoint.key] = best
        return scores
