"""Proposes n-gram drafts for the decoding requests before each step.

The engine core asks `NgramDrafter.propose` for drafts every step and hands them to
`Scheduler.schedule` as data (by request id); the scheduler plans K+1 query tokens per
speculating row within the token budget and the KV pool, and the drafts are valid for that one
step only. Drafts are capped so a step can never produce more tokens than the request may still
get (max_tokens, max_model_len): a draft past that limit would cost compute and could never be
kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_engine.core.request import Request
from baton_engine.spec_decode.ngram_proposer import NgramProposer
from baton_engine.spec_decode.token_buffer import TokenBuffer


class NgramDrafter:
    """Implements `baton_engine.core.engine_core.Drafter`."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        self._buffers: dict[int, TokenBuffer] = {}

    def propose(self, requests: Sequence[Request], max_model_len: int) -> dict[int, list[int]]:
        """Drafts by request id for the decoding `requests` (those with room for one, non-empty)."""
        drafts: dict[int, list[int]] = {}
        buffers: dict[int, TokenBuffer] = {}
        previous = self._buffers
        for request in requests:
            room = min(
                request.sampling_params.max_tokens - request.num_output_tokens,
                max_model_len - request.num_tokens,
            )
            buffer = previous.get(request.req_id)
            if buffer is None:
                buffer = TokenBuffer(request.num_tokens + 64)
            buffers[request.req_id] = buffer
            tokens = buffer.sync(request.token_ids)
            # The verify step yields up to drafts + 1 tokens: drafts <= room - 1.
            proposed = self.proposer.propose(tokens, room - 1) if room > 1 else []
            if proposed:
                drafts[request.req_id] = proposed
        # Buffers of requests no longer decoding (finished, preempted) are dropped here.
        self._buffers = buffers
        return drafts
