"""One request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from baton_engine.core.sampling_params import SamplingParams
from baton_engine.prefix.hashing import BlockHash

if TYPE_CHECKING:
    from baton_engine.core.batch import BatchState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Queued for (re)admission: needs a prefill (or the rest of one)."""
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """P/D consumer: blocks reserved, KV being pulled from a producer; skipped by the scheduler."""
    RUNNING = "running"
    """Has a row in the persistent batch (prefilling or decoding)."""
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    """EOS or a stop token id (or a stop string, reported by the detokenizer's abort)."""
    LENGTH = "length"
    """max_tokens or max_model_len reached."""
    ABORT = "abort"
    """Aborted by the client or the server."""
    REJECTED = "rejected"
    """Can never be scheduled (see `Request.finish_message`)."""


class Request:
    """Token ids, progress, blocks and timestamps of one request (one completion of it).

    While the sequence has a row in the persistent batch, `num_computed_tokens` and
    `last_token_time` live in the batch's arrays (updated vectorised each step); the properties
    read them there and they are copied back when the row is released.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.finish_message: str | None = None
        """Human-readable detail of the finish: the rejection reason, or the stop token matched."""
        self.stop_token_id: int | None = None
        """The EOS / stop token id that finished the request, if any."""

        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []
        """Chain keys of the leading full blocks of `token_ids` (computed lazily, kept across
        preemption since the tokens do not change)."""
        self.num_published_blocks = 0
        """Leading blocks whose KV is computed and whose key has been published (or hit)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the latest admission."""
        self._num_computed_tokens = 0

        self.draft_token_ids: list[int] = []
        """Speculative drafts for the next step: set by the drafter, cleared by the scheduler
        after each step (drafts are only valid for one position)."""
        self.num_preemptions = 0

        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self._last_token_time: float | None = None

        self.kv_transfer_params = kv_transfer_params
        """P/D parameters as received (consumer) — interpreted by the KV-transfer layer."""
        self.hold_blocks_for_transfer: str | None = None
        """Producer: a transfer id; when set, the finished request keeps its blocks until
        `Scheduler.release(transfer_id)` or its lease expires."""

        self._batch: BatchState | None = None
        self._row = -1

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache (prefix hits, computed chunks, decode steps)."""
        if self._batch is not None:
            return int(self._batch.num_computed[self._row])
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._batch is not None:
            self._batch.num_computed[self._row] = value
        else:
            self._num_computed_tokens = value

    @property
    def last_token_time(self) -> float | None:
        """When the latest output token was appended (monotonic clock)."""
        if self._batch is not None:
            stamp = float(self._batch.last_token_time[self._row])
            return None if stamp < 0 else stamp
        return self._last_token_time

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
