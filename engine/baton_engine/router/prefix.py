"""Seams for prefix-aware routing: the request's token ids, their block hashes, and the KV-event
index that knows which pod caches which blocks.

The router needs the same token ids, block size and block hash as the engines. Those come from
other parts of Baton (the torch-free tokenizer, the engines' hash, the KV-event subscriber); the
router only depends on the protocols below, so any of them can be left out, in which case every
pod scores zero cached blocks and routing falls back to load alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from baton_engine.router.endpoints import Endpoint

log = logging.getLogger(__name__)

Api = Literal["completions", "chat"]


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


class PrefixScorer:
    """Cached prompt blocks per candidate endpoint for one request."""

    def __init__(
        self,
        *,
        tokenizer: RequestTokenizer | None = None,
        hasher: BlockHasher | None = None,
        index: PrefixMatcher | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.index = index

    @property
    def enabled(self) -> bool:
        return self.hasher is not None and self.index is not None

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
        if self.hasher is None or self.index is None or not endpoints:
            return {}
        ids = self.token_ids(api, body)
        if not ids:
            return {}
        hashes = self.hasher.block_hashes(ids)
        if not hashes:
            return {}
        matches = self.index.longest_prefix_match(hashes)
        if not matches:
            return {}
        scores: dict[str, int] = {}
        for endpoint in endpoints:
            aliases = endpoint.aliases()
            best = max((blocks for pod, blocks in matches.items() if pod in aliases), default=0)
            if best:
                scores[endpoint.key] = best
        return scores
