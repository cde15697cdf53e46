"""One request as the engine core sees it: its tokens, progress and timestamps.

Who owns what (docs/engine.md, "State owners"): the scheduler writes a `Request`'s fields; its
KV blocks and their keys belong to the `KVCacheManager`; while it runs, its row (block table,
counters, sampling parameters as arrays) belongs to the `PersistentBatch`. A `Request` holds no
reference to either.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from baton_engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Queued for (re)admission: needs a prefill (or the rest of one)."""
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """P/D consumer: waits for blocks to pull its prompt's KV into, or for that pull to end."""
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    """Its grammar compiles (off the step loop); then it is queued as WAITING (or, on a P/D
    consumer, WAITING_FOR_REMOTE_KV)."""
    RUNNING = "running"
    """Has a row in the persistent batch (prefilling or decoding)."""
    FINISHED = "finished"
    """Done: `finish_reason` says why; it is reported once and then forgotten."""


class FinishReason(enum.Enum):
    STOP = "stop"
    """EOS or a stop token id (or a stop string, reported by the detokenizer's abort)."""
    LENGTH = "length"
    """max_tokens or max_model_len reached."""
    ABORT = "abort"
    """Aborted by the client or the server, or its KV transfer failed (policy ``fail``)."""
    REJECTED = "rejected"
    """Can never be scheduled (see `Request.finish_message`)."""


class Request:
    """Token ids, progress and timestamps of one request (one completion of it)."""

    def __init__(
        self,
        req_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        client_id: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.req_id = req_id
        """The engine core's id of this request (rows, blocks and outputs are keyed by it)."""
        self.client_id = str(req_id) if client_id is None else client_id
        """The caller's id (`EngineCore.add_request`'s ``request_id``); outputs carry it."""
        self.token_ids: list[int] = list(prompt_token_ids)
        """Prompt then output tokens. The scheduler appends to this list (through the batch's
        reference to it while the request runs)."""
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.finish_message: str | None = None
        """Human-readable detail of the finish: the rejection reason, or the stop token matched."""
        self.stop_token_id: int | None = None
        """The EOS / stop token id that finished the request, if any."""

        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (prefix hits, computed chunks, decode steps). While the
        request has a row, the batch's counter is the current one (updated vectorised each step)
        and this field is written back when the row is released: read it through
        `Scheduler.num_computed_tokens`."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the latest admission."""
        self.num_preemptions = 0

        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        """When the latest output token was appended (monotonic clock); like
        `num_computed_tokens`, current in the batch while the request has a row."""

        self.kv_transfer_params_out: dict[str, Any] | None = None
        """P/D producer: the signed kv_transfer_params a consumer pulls this request's KV with,
        set by the KV connector when the finished request's blocks were leased."""

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request(id={self.req_id}, status={self.status.value}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens})"
        )
