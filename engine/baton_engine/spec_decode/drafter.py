"""Proposes n-gram drafts for the decoding sequences before each `Scheduler.schedule()`.

The scheduler reads ``Request.draft_token_ids`` when it plans a step (K+1 query tokens per
speculating row, within the token budget and the KV pool) and clears them after the step, so
the engine core calls `NgramDrafter.before_schedule` every step. Drafts are capped so a step
can never produce more tokens than the request may still get (max_tokens, max_model_len): a
draft past that limit would cost compute and could never be kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from baton_engine.core.request import Request
from baton_engine.core.scheduler import Scheduler
from baton_engine.spec_decode.ngram_proposer import NgramProposer
from baton_engine.spec_decode.stats_log import SpecDecodeLogger
from baton_engine.spec_decode.token_buffer import TokenBuffer


class NgramDrafter:
    def __init__(
        self,
        proposer: NgramProposer,
        *,
        logger: SpecDecodeLogger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proposer = proposer
        self.logger = logger
        self.clock = clock
        self._buffers: dict[int, TokenBuffer] = {}

    def before_schedule(self, scheduler: Scheduler) -> None:
        batch = scheduler.batch
        self.propose(batch.seqs[: batch.num_decode], scheduler.max_model_len)
        if self.logger is not None:
            self.logger.maybe_log(scheduler.spec_stats, self.clock())

    def propose(self, seqs: list[Request], max_model_len: int) -> None:
        """Set ``draft_token_ids`` of every sequence in `seqs` (all decoding)."""
        buffers: dict[int, TokenBuffer] = {}
        previous = self._buffers
        for seq in seqs:
            room = min(seq.sampling_params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
            buffer = previous.get(seq.seq_id)
            if buffer is None:
                buffer = TokenBuffer(seq.num_tokens + 64)
            buffers[seq.seq_id] = buffer
            tokens = buffer.sync(seq.token_ids)
            # The verify step yields up to drafts + 1 tokens: drafts <= room - 1.
            seq.draft_token_ids = self.proposer.propose(tokens, room - 1) if room > 1 else []
        # Buffers of sequences no longer decoding (finished, preempted) are dropped here.
        self._buffers = buffers
