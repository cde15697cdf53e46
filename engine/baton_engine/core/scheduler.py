"""The scheduler: which requests run each step, how many tokens each, and what happens after.

Each step is a *mixed* batch: every decoding request gets exactly one token (1 + K with K
drafts), then the rest of the token budget goes to prefills — first requests already
prefilling (chunked prefill), then new admissions from the waiting queue (FIFO). When a decode
step cannot get a block, the most recently admitted running request is preempted: its blocks
are freed and it re-enters the waiting queue to recompute its KV later (its tokens are kept, so
its output does not change). Requests that can never fit are finished with a rejection reason.

Engine loop (`EngineCore.step`)::

    out = scheduler.schedule(drafts)
    if out.num_rows:
        result = runner.execute(out)
        step = scheduler.postprocess(out, result)
    events = scheduler.kv_cache_manager.take_events()

State owners: the scheduler writes `Request`s and owns the queues; the `KVCacheManager` owns
request -> blocks (the scheduler copies what it hands out into the batch); the `PersistentBatch`
owns rows and the block table; the `StructuredOutputManager` owns request -> grammar state (the
scheduler drives it: a request's grammar is added when it is queued, its drafts are cut to what
the grammar allows, each step carries the bitmasks of its constrained positions, kept tokens are
accepted, and a request whose grammar is complete finishes with ``stop``). P/D goes through the
`KVConnector` Protocol: the scheduler calls its hooks and applies its `KVConnectorUpdates` at the
start of each step.

The decode path is vectorised over the persistent batch; per-request Python work happens only
for rows that cross a block boundary, finish, change state, or follow a grammar.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from baton_engine.core.batch import PersistentBatch
from baton_engine.core.kv_cache_manager import KVCacheManager
from baton_engine.core.kv_connector import KVConnector, RemoteKVArrived, RemoteKVFailed
from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.scheduler_output import Int64Array, ModelRunnerOutput, SchedulerOutput
from baton_engine.core.scheduler_stats import PrefixCacheStats, SchedulerStats, SpecDecodeStats
from baton_engine.core.step_builder import build_step
from baton_engine.prefix.hashing import PrefixHasher, fast_prefix_hash
from baton_engine.structured.grammar import StructuredOutputError
from baton_engine.structured.manager import GrammarRefusedToken, SampledRow, StructuredOutputManager

if TYPE_CHECKING:
    from baton_engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one `postprocess` produced, for streaming and metrics."""

    step_id: int
    req_ids: list[int]
    """Requests that gained tokens this step (the sampling rows, in row order)."""
    token_lists: list[list[int]] | None = None
    """Speculative steps: the tokens appended to each of `req_ids` (a run is cut after a stop
    token). None when each gained exactly one, in `token_array`."""
    token_array: Int64Array | None = None
    """Steps without drafts: the one token each of `req_ids` gained (the runner's array, kept
    as is: readers that need only which requests moved pay no per-row list)."""
    logprobs: list[list[list[tuple[int, float]]]] | None = None
    """The runner's logprobs, aligned with `new_token_ids` (cut the same way); None if none."""
    finished: list[Request] = field(default_factory=list)
    """Requests finished since the previous `postprocess`: stopped here, or rejected or aborted
    in between."""
    timestamp: float = 0.0
    """Clock reading when the tokens were appended (their arrival time for ITL)."""

    @property
    def new_token_ids(self) -> list[list[int]]:
        """The tokens appended to each of `req_ids`, as lists (built from `token_array` when
        that carries them)."""
        if self.token_lists is not None:
            return self.token_lists
        if self.token_array is None:
            return []
        return [[t] for t in self.token_array.tolist()]


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        eos_token_id: int | None = None,
        scheduler_delay_factor: float = 0.0,
        num_speculative_tokens: int = 0,
        prefix_hasher: PrefixHasher = fast_prefix_hash,
        enable_kv_events: bool = True,
        kv_connector: KVConnector | None = None,
        structured_output: StructuredOutputManager | None = None,
        clock: Callable[[], float] = time.monotonic,
        decode_lookahead: bool = False,
    ) -> None:
        """`structured_output`: follows the grammars of requests that have one (None: such
        requests are rejected, e.g. for a model without a tokenizer). `decode_lookahead`: give
        each decode row the block of its next step's token one step early, when the pool has
        them all without preempting (`SchedulerOutput.decode_lookahead`); not with speculation or a
        KV connector."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                f"({max_num_seqs}) so that every running request can decode in every step"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if scheduler_delay_factor < 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {scheduler_delay_factor}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_id = eos_token_id
        self.delay_factor = scheduler_delay_factor
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_connector = kv_connector
        self.structured_output = structured_output
        self.clock = clock
        self.decode_lookahead = decode_lookahead and not num_speculative_tokens and kv_connector is None

        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            hasher=prefix_hasher,
            record_events=enable_kv_events,
        )
        max_blocks_per_request = -(-(max_model_len + num_speculative_tokens + 1) // block_size)
        self.batch = PersistentBatch(max_num_seqs, max_blocks_per_request)

        self.waiting: deque[Request] = deque()
        self._admitted: dict[int, Request] = {}  # running requests in admission order
        self._unfinished: dict[int, Request] = {}
        self._remote_pending: dict[int, Request] = {}  # blocks reserved, KV being pulled
        self._arrived: deque[Request] = deque()  # KV pulled into their blocks, waiting for a row
        self._aborted_while_pulling: dict[int, str | None] = {}  # req id -> abort message
        self._held: dict[int, Request] = {}  # producer: finished, blocks leased for a pull
        self._finished: list[Request] = []  # since the last postprocess
        self._finished_ids: list[int] = []  # since the last schedule
        self._stop_id_rows = 0  # running rows whose params have stop_token_ids
        self._stop_id_union: Int64Array = np.zeros(0, dtype=np.int64)

        self._step_id = 0
        self._in_flight: SchedulerOutput | None = None
        self._pending_aborts: list[tuple[int, str | None]] = []

        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0

        self.prefix_cache_stats = PrefixCacheStats()
        self.spec_stats = SpecDecodeStats(num_speculative_tokens)
        self.num_preemptions = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        num_blocks: int,
        eos_token_id: int | None,
        prefix_hasher: PrefixHasher = fast_prefix_hash,
        kv_connector: KVConnector | None = None,
        structured_output: StructuredOutputManager | None = None,
        clock: Callable[[], float] = time.monotonic,
        decode_lookahead: bool = False,
    ) -> Scheduler:
        return cls(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_id=eos_token_id,
            scheduler_delay_factor=config.scheduler_delay_factor,
            num_speculative_tokens=config.num_speculative_tokens,
            prefix_hasher=prefix_hasher,
            enable_kv_events=config.kv_events,
            kv_connector=kv_connector,
            structured_output=structured_output,
            clock=clock,
            decode_lookahead=decode_lookahead,
        )

    # -- inspection -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._remote_pending) + len(self._arrived)

    @property
    def num_running(self) -> int:
        return self.batch.num_rows

    @property
    def num_held_transfers(self) -> int:
        return len(self._held)

    @property
    def num_parked(self) -> int:
        """P/D consumers holding KV blocks without a row: pulling, or their KV arrived. Running
        plus parked stays within `max_num_seqs` (a parked consumer is admitted: it needs a row)."""
        return len(self._remote_pending) + len(self._arrived)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._finished)

    def get(self, req_id: int) -> Request | None:
        return self._unfinished.get(req_id)

    def num_computed_tokens(self, request: Request) -> int:
        """Tokens of `request` whose KV is in the cache (the batch's counter while it runs)."""
        batch = self.batch
        if batch.has_row(request.req_id):
            return int(batch.num_computed[batch.row_of(request.req_id)])
        return request.num_computed_tokens

    def decoding_requests(self) -> list[Request]:
        """The requests in decode rows, in row order (what a drafter proposes for)."""
        return self.batch.requests[: self.batch.num_decode]

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        prefix = self.prefix_cache_stats
        spec = self.spec_stats
        return SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_held_transfers=self.num_held_transfers,
            kv_cache_usage=kv.usage(),
            num_kv_blocks=kv.num_blocks,
            num_used_kv_blocks=kv.num_used_blocks,
            num_preemptions=self.num_preemptions,
            prefix_queried_tokens=prefix.queried_tokens,
            prefix_hit_tokens=prefix.hit_tokens,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_num_drafts=spec.num_forwards,
            spec_accepted_per_position=list(spec.accepted_per_position),
            num_grammar_requests=len(self.structured_output or ()),
        )

    # -- admission --------------------------------------------------------------------------
    def rejection_reason(self, request: Request) -> str | None:
        """Why `request` can never be (re)computed with this configuration, or None."""
        n = request.num_tokens
        what = "prompt" if request.num_output_tokens == 0 else "prompt + output"
        if n > self.max_model_len:
            return (
                f"{what} has {n} tokens, more than max_model_len={self.max_model_len}; "
                "shorten the prompt or raise --max-model-len"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (
                f"{what} has {n} tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is off; enable chunked prefill "
                "or raise --max-num-batched-tokens"
            )
        kv = self.kv_cache_manager
        needed = kv.blocks_needed(n)
        if needed > kv.num_blocks:
            return (
                f"{what} needs {needed} KV blocks, more than the whole pool "
                f"({kv.num_blocks} blocks of {self.block_size} tokens)"
            )
        return None

    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_REMOTE_KV on a P/D consumer).

        A request that can never fit is finished at once with reason REJECTED; it is reported in
        the next `postprocess` / `take_finished`.
        """
        if request.req_id in self._unfinished:
            raise ValueError(f"request id {request.req_id} is already scheduled")
        if request.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV):
            raise ValueError(f"request {request.req_id} has status {request.status.value}, expected waiting")
        reason = self.rejection_reason(request) or self._add_grammar(request)
        if reason is not None:
            self._mark_finished(request, FinishReason.REJECTED, reason)
            return
        self._unfinished[request.req_id] = request
        self.waiting.append(request)

    def _add_grammar(self, request: Request) -> str | None:
        """Start following `request`'s grammar, if it has one; why it cannot be followed, or None."""
        grammar = request.sampling_params.grammar
        if grammar is None:
            return None
        if self.structured_output is None:
            return "grammar: this engine cannot follow grammars (its model has no tokenizer)"
        try:
            self.structured_output.add(request.req_id, grammar)
        except StructuredOutputError as exc:
            return str(exc)  # "grammar: ..." (the server names the request field it came from)
        return None

    @property
    def _grammars(self) -> StructuredOutputManager | None:
        """The manager while it follows any request (steps without one skip all grammar work)."""
        manager = self.structured_output
        return manager if manager is not None and len(manager) else None

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[int, Sequence[int]] | None = None) -> SchedulerOutput:
        """Pick this step's batch. `drafts`: speculative draft tokens by request id (decoding
        requests only; valid for this step). Unless the step is empty, call `postprocess` with
        its result before the next call."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before postprocess() of the previous step")
        if self.kv_connector is not None:
            self.update_from_kv_connector()
        now = self.clock()
        self._step_id += 1
        batch = self.batch
        budget = self.max_num_batched_tokens

        # 1. Every decode row gets its token(s); find blocks for them, preempting if needed.
        if self.num_speculative_tokens:
            self._plan_drafts(budget, drafts or {})
        preemptions_before = self.num_preemptions
        self._grow_decode_blocks()
        preempted = self.num_preemptions != preemptions_before
        lookahead = self.decode_lookahead and self._grow_lookahead_blocks()
        num_decode = batch.num_decode
        num_decode_tokens = num_decode
        if self.num_speculative_tokens and num_decode:
            num_decode_tokens += int(batch.num_drafts[:num_decode].sum())
        budget -= num_decode_tokens

        # 2. Requests already prefilling continue, in order, while the budget lasts.
        chunks: list[int] = []
        nc, nt = batch.num_computed, batch.num_tokens
        for row in range(num_decode, batch.num_rows):
            if budget <= 0:
                break
            chunk = min(int(nt[row] - nc[row]), budget)
            chunks.append(chunk)
            budget -= chunk

        # 3. Admit waiting requests once every running prefill got all it needs. Not in a step
        # that had to preempt: the victim would come straight back and thrash.
        delay_passed = self.delay_factor <= 0 or self._passed_delay(now)
        all_prefills_served = num_decode + len(chunks) == batch.num_rows
        queued = self.waiting or self._arrived
        if budget > 0 and all_prefills_served and queued and delay_passed and not preempted:
            budget = self._admit(budget, chunks, now)

        finished_ids, self._finished_ids = self._finished_ids, []
        out = build_step(
            batch,
            step_id=self._step_id,
            num_decode=num_decode,
            chunks=chunks,
            block_size=self.block_size,
            drafts=drafts if self.num_speculative_tokens else None,
            finished_req_ids=finished_ids,
        )
        out.decode_lookahead = lookahead
        grammars = self._grammars
        if grammars is not None:
            self._attach_bitmask(out, grammars, drafts if self.num_speculative_tokens else None)
        # An empty step has nothing to run or postprocess (report finishes via take_finished).
        self._in_flight = out if out.num_rows else None
        return out

    def _plan_drafts(self, budget: int, drafts: Mapping[int, Sequence[int]]) -> None:
        batch = self.batch
        k = self.num_speculative_tokens
        room = budget - batch.num_decode
        grammars = self._grammars
        for row in range(batch.num_decode):
            request = batch.requests[row]
            proposed = drafts.get(request.req_id)
            if proposed and grammars is not None and batch.has_grammar[row]:
                proposed = grammars.cut_drafts(request.req_id, list(proposed))
            wanted = min(len(proposed), k, self.max_model_len - request.num_tokens, room) if proposed else 0
            wanted = max(wanted, 0)
            batch.num_drafts[row] = wanted
            room -= wanted

    def _grow_decode_blocks(self) -> None:
        batch = self.batch
        kv = self.kv_cache_manager
        bs = self.block_size
        while batch.num_decode:
            d = batch.num_decode
            needed_tokens = batch.num_computed[:d] + 1
            if self.num_speculative_tokens:
                needed_tokens += batch.num_drafts[:d]
            needed_blocks = (needed_tokens + (bs - 1)) // bs
            short_rows = np.flatnonzero(needed_blocks > batch.num_blocks[:d])
            if not len(short_rows):
                return
            missing_blocks = needed_blocks[short_rows] - batch.num_blocks[short_rows]
            if kv.num_free_blocks >= len(short_rows) and (missing_blocks == 1).all():
                # Common case: each short row needs exactly one block and the pool has them.
                req_ids = batch.req_ids
                new_blocks = kv.append_one_block_each([req_ids[row] for row in short_rows.tolist()])
                batch.append_block_per_row(short_rows, new_blocks)
                return
            preempted = False
            for row in short_rows.tolist():
                missing = int(needed_blocks[row] - batch.num_blocks[row])
                if kv.num_free_blocks < missing and batch.num_drafts[row]:
                    # Drop this row's drafts before preempting anyone for them.
                    batch.num_drafts[row] = 0
                    missing = int((batch.num_computed[row] + bs) // bs - batch.num_blocks[row])
                    if missing <= 0:
                        continue
                if kv.num_free_blocks >= missing:
                    request = batch.requests[row]
                    tokens = int(batch.num_blocks[row] + missing) * bs
                    batch.append_blocks(row, kv.append_slots(request, tokens))
                    continue
                self._preempt(next(reversed(self._admitted.values())))
                preempted = True
                break
            if not preempted:
                return

    def _grow_lookahead_blocks(self) -> bool:
        """Each decode row gets the block of its next step's token now, if that token opens one;
        all of them or, when the pool lacks blocks, none (a prediction never preempts). Rows
        that finish in this step get theirs too: a step run ahead computes every row of this
        one, and its write must land in a block the row holds. True when every decode row owns
        its next token's slot."""
        batch = self.batch
        d = batch.num_decode
        bs = self.block_size
        needed_blocks = (batch.num_computed[:d] + 2 + (bs - 1)) // bs
        short_rows = np.flatnonzero(needed_blocks > batch.num_blocks[:d])
        if not len(short_rows):
            return True
        kv = self.kv_cache_manager
        if kv.num_free_blocks < len(short_rows):
            return False
        new_blocks = kv.append_one_block_each([batch.req_ids[row] for row in short_rows.tolist()])
        batch.append_block_per_row(short_rows, new_blocks)
        return True

    def _admit(self, budget: int, chunks: list[int], now: float) -> int:
        """Give rows to queued requests, first come first served within each queue: first the P/D
        consumers whose KV arrived (they hold blocks already), then the waiting queue (preempted
        requests at its front, then arrivals; a consumer there gets its blocks reserved for the
        pull). Stops at the first request that does not fit, so nobody is overtaken."""
        batch = self.batch
        kv = self.kv_cache_manager
        admitted_any = False
        while self._arrived and budget > 0 and batch.num_rows < self.max_num_seqs:
            request = self._arrived[0]
            reason = self.rejection_reason(request)
            if reason is not None:  # the producer's first token made it too long for this pool
                self._arrived.popleft()
                self._finish_unschedulable(request, "cannot run after its KV arrived", reason)
                continue
            missing = kv.blocks_needed(request.num_tokens) - kv.num_blocks_of(request.req_id)
            if missing > kv.num_free_blocks and not self._make_room(missing):
                break
            num_new = request.num_tokens - request.num_computed_tokens
            if not self.enable_chunked_prefill and num_new > budget:
                break
            kv.append_slots(request, request.num_tokens)
            self._arrived.popleft()
            budget = self._start(request, num_new, budget, chunks, now)
            admitted_any = True
        while (
            not self._arrived
            and self.waiting
            and budget > 0
            and batch.num_rows + self.num_parked < self.max_num_seqs
        ):
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                if not self._reserve_for_remote(request):
                    break
                self.waiting.popleft()
                continue
            reason = self.rejection_reason(request)
            if reason is not None:
                # Only a preempted request that grew past what can ever be recomputed gets here.
                self.waiting.popleft()
                self._finish_unschedulable(request, "cannot resume after preemption", reason)
                continue
            hits = kv.find_prefix_hits(request)
            if hits is None:
                break
            num_new = request.num_tokens - hits * self.block_size
            if not self.enable_chunked_prefill and num_new > budget:
                break
            self._allocate(request, hits)
            self.waiting.popleft()
            budget = self._start(request, num_new, budget, chunks, now)
            admitted_any = True
        if admitted_any:
            self._prev_prompt = True
        return budget

    def _start(self, request: Request, num_new: int, budget: int, chunks: list[int], now: float) -> int:
        """Give admitted `request` the next prefill row and its first chunk; the budget left."""
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        self._admitted[request.req_id] = request
        self._add_row(request)
        chunk = min(num_new, budget)
        chunks.append(chunk)
        return budget - chunk

    def _finish_unschedulable(self, request: Request, what: str, reason: str) -> None:
        """A queued request that can never be computed in this pool: one with output ends as if it
        hit a length limit (it did: the pool's), one without is rejected."""
        del self._unfinished[request.req_id]
        if request.num_output_tokens:
            self._mark_finished(request, FinishReason.LENGTH, f"{what}: {reason}")
        else:
            self._mark_finished(request, FinishReason.REJECTED, reason)

    def _make_room(self, num_blocks: int) -> bool:
        """Free blocks for the first arrived consumer by preempting, by recompute, the most recently
        arrived of the other parked ones (as a local decode preempts the most recently admitted).
        Rows of this step are already planned, so running requests are left alone: they free
        blocks by finishing or, short of blocks themselves, by preempting each other."""
        kv = self.kv_cache_manager
        while kv.num_free_blocks < num_blocks and len(self._arrived) > 1:
            victim = self._arrived.pop()
            kv.free(victim.req_id, keep_keys=True)
            self._to_recompute(victim)
        return kv.num_free_blocks >= num_blocks

    def _to_recompute(self, request: Request) -> None:
        """Back to the front of the waiting queue to compute its KV again (its tokens are kept,
        so its output does not change)."""
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _allocate(self, request: Request, num_hit_blocks: int) -> None:
        blocks = self.kv_cache_manager.allocate(request, num_hit_blocks)
        hit_tokens = blocks.num_hit_blocks * self.block_size
        request.num_cached_tokens = hit_tokens
        request.num_computed_tokens = hit_tokens
        self.prefix_cache_stats.record(request.num_tokens, hit_tokens)

    def _passed_delay(self, now: float) -> bool:
        # Hold new prompts until the oldest has waited delay_factor x the last prompt step's
        # latency, so arrivals batch up (never while nothing is running).
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if not self.waiting or not self._admitted:
            return True
        earliest = min(request.arrival_time for request in self.waiting)
        return (now - earliest) > self.delay_factor * self._last_prompt_latency

    def _add_row(self, request: Request) -> None:
        block_ids = self.kv_cache_manager.block_ids(request.req_id)
        self.batch.add_row(request, block_ids, self.eos_token_id, self.max_model_len)
        if request.sampling_params.stop_token_ids:
            self._stop_id_rows += 1
            union = set(self._stop_id_union.tolist()) | set(request.sampling_params.stop_token_ids)
            self._stop_id_union = np.array(sorted(union), dtype=np.int64)

    def _remove_row(self, request: Request) -> None:
        released = self.batch.release_row(request.req_id)
        request.num_computed_tokens = released.num_computed_tokens
        request.last_token_time = released.last_token_time
        del self._admitted[request.req_id]
        if request.sampling_params.stop_token_ids:
            self._stop_id_rows -= 1
            if self._stop_id_rows == 0:
                self._stop_id_union = np.zeros(0, dtype=np.int64)

    def _attach_bitmask(
        self,
        out: SchedulerOutput,
        grammars: StructuredOutputManager,
        drafts: Mapping[int, Sequence[int]] | None,
    ) -> None:
        """The bitmasks of the step's constrained sampled positions (`grammar_bitmask`)."""
        batch = self.batch
        num_sample = len(out.sample_rows)
        constrained = np.flatnonzero(batch.has_grammar[:num_sample]).tolist()
        if not constrained:
            return
        counts = 1 + out.num_draft_tokens[:num_sample].astype(np.int64)
        first_logits_row = (np.cumsum(counts) - counts).tolist()
        req_ids = batch.req_ids
        rows = []
        for row in constrained:
            req_id = req_ids[row]
            num_drafts = int(out.num_draft_tokens[row])
            row_drafts = tuple(drafts[req_id][:num_drafts]) if drafts is not None and num_drafts else ()
            rows.append(SampledRow(req_id, first_logits_row[row], row_drafts))
        step = grammars.step_bitmask(rows)
        out.grammar_bitmask = step.bitmask
        out.grammar_rows = np.asarray(step.logits_rows, dtype=np.int64)

    # -- postprocess ------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, result: ModelRunnerOutput) -> StepResult:
        """Apply step `out`'s sampled tokens: append, check stops, publish blocks, free."""
        if self._in_flight is not out:
            raise RuntimeError(f"step {out.step_id} is not the step in flight")
        if result.step_id != out.step_id:
            raise ValueError(f"runner output is for step {result.step_id}, expected {out.step_id}")
        num_sample = len(out.sample_rows)
        if len(result.sampled_token_ids) != num_sample and result.sampled_token_array is None:
            raise ValueError(
                f"runner returned tokens for {len(result.sampled_token_ids)} rows, expected {num_sample}"
            )
        self._in_flight = None
        now = self.clock()
        batch = self.batch
        b = out.num_rows
        num_decode = out.num_decode_rows
        prefill_rows = batch.requests[num_decode:b]
        completing = batch.requests[num_decode:num_sample]
        token_array: Int64Array | None = None
        token_lists: list[list[int]] | None
        if out.num_decode_tokens > num_decode:
            finishing, token_lists = self._apply_speculative(out, result, now)
        else:
            finishing, token_array, token_lists = self._apply_tokens(out, result, now)

        kv = self.kv_cache_manager
        if kv.enable_prefix_caching:
            computed = batch.num_computed
            if out.num_decode_tokens > num_decode:
                for row in range(num_decode):
                    kv.publish(batch.requests[row], int(computed[row]))
            else:
                crossed = np.flatnonzero(computed[:num_decode] % self.block_size == 0)
                if len(crossed):
                    requests = batch.requests
                    kv.publish_next_block(
                        [requests[row] for row in crossed.tolist()], computed[crossed].tolist()
                    )
            for request in prefill_rows:
                kv.publish(request, int(computed[batch.row_of(request.req_id)]))

        for request in completing:
            if request.first_token_time is None:
                request.first_token_time = now
        for request, reason in finishing:
            self._finish_running(request, reason)
        for request in completing:
            if request.status is RequestStatus.RUNNING:
                batch.promote_to_decode(request.req_id)
        self._apply_pending_aborts()

        finished, self._finished = self._finished, []
        return StepResult(
            step_id=out.step_id,
            req_ids=out.req_ids[:num_sample],
            token_lists=token_lists,
            token_array=token_array,
            logprobs=self._align_logprobs(result, token_lists, num_sample),
            finished=finished,
            timestamp=now,
        )

    @staticmethod
    def _align_logprobs(
        result: ModelRunnerOutput, token_lists: list[list[int]] | None, num_sample: int
    ) -> list[list[list[tuple[int, float]]]] | None:
        """The runner's logprobs cut like the tokens (a speculative run is cut after a stop)."""
        if result.logprobs is None:
            return None
        if len(result.logprobs) != num_sample:
            raise ValueError(
                f"runner returned logprobs for {len(result.logprobs)} rows, expected {num_sample}"
            )
        if token_lists is None:
            return [row[:1] for row in result.logprobs]
        return [
            row if len(row) == len(tokens) else row[: len(tokens)]
            for row, tokens in zip(result.logprobs, token_lists, strict=True)
        ]

    def discard_step(self, out: SchedulerOutput) -> None:
        """Forget step `out` without applying it (the forward failed): nothing it computed counts,
        so the next step recomputes the same tokens. Aborts requested meanwhile are applied."""
        if self._in_flight is not out:
            raise RuntimeError(f"step {out.step_id} is not the step in flight")
        self._in_flight = None
        self._apply_pending_aborts()

    def _apply_pending_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, []
        for req_id, message in pending:
            self.abort(req_id, message)

    def _apply_tokens(
        self, out: SchedulerOutput, result: ModelRunnerOutput, now: float
    ) -> tuple[list[tuple[Request, FinishReason]], Int64Array, list[list[int]] | None]:
        """Vectorised path: every sampling row gained exactly one token. Returns the finishing
        requests, the tokens as an array, and the runner's per-row lists if it gave them."""
        batch = self.batch
        b = out.num_rows
        s = len(out.sample_rows)
        lists: list[list[int]] | None
        if result.sampled_token_array is not None:
            tokens = np.asarray(result.sampled_token_array, dtype=np.int64)
            if tokens.shape != (s,):
                raise ValueError(f"sampled_token_array has shape {tokens.shape}, expected ({s},)")
            lists = result.sampled_token_ids if len(result.sampled_token_ids) == s else None
        else:
            lists = result.sampled_token_ids
            if any(len(t) != 1 for t in lists):
                raise ValueError("expected exactly one sampled token per row (no drafts this step)")
            tokens = np.fromiter((t[0] for t in lists), dtype=np.int64, count=s)
        batch.num_computed[:b] += out.query_lens
        batch.last_token[:s] = tokens
        batch.num_tokens[:s] += 1
        batch.last_token_time[:s] = now
        token_list = tokens.tolist()
        deque(map(list.append, batch.token_lists[:s], token_list), maxlen=0)

        stop = (tokens == batch.eos[:s]) | (batch.num_tokens[:s] >= batch.stop_len[:s])
        if self._stop_id_rows:
            stop |= np.isin(tokens, self._stop_id_union) & batch.has_stop_ids[:s]
        grammar_ends: dict[int, FinishReason] = {}
        if out.grammar_bitmask is not None:
            for row in np.flatnonzero(batch.has_grammar[:s]).tolist():
                end = self._accept_grammar(batch.requests[row], token_list[row])
                if end is not None:
                    grammar_ends[row] = end
                    stop[row] = True
        finishing: list[tuple[Request, FinishReason]] = []
        for row in np.flatnonzero(stop).tolist():
            request = batch.requests[row]
            reason = grammar_ends.get(row) or self._stop_reason(request, token_list[row], request.num_tokens)
            if reason is not None:
                finishing.append((request, reason))
        return finishing, tokens, lists

    def _accept_grammar(self, request: Request, token: int) -> FinishReason | None:
        """Advance `request`'s grammar by its new `token`: STOP once the grammar is complete."""
        if self.structured_output is None or request.req_id not in self.structured_output:
            return None
        try:
            complete = self.structured_output.accept(request.req_id, [token])
        except GrammarRefusedToken as exc:
            # The step's mask allowed only grammar tokens: this is a bug, and it ends this
            # request only (never the step loop).
            log.error("request %d: sampled %s; aborting it", request.req_id, exc)
            request.finish_message = f"structured output failed: sampled {exc}"
            return FinishReason.ABORT
        return FinishReason.STOP if complete else None

    def _stop_reason(self, request: Request, token: int, num_tokens: int) -> FinishReason | None:
        params = request.sampling_params
        if token == self.eos_token_id and not params.ignore_eos:
            request.stop_token_id = token
            return FinishReason.STOP
        if token in params.stop_token_ids:
            request.stop_token_id = token
            return FinishReason.STOP
        if num_tokens - request.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _apply_speculative(
        self, out: SchedulerOutput, result: ModelRunnerOutput, now: float
    ) -> tuple[list[tuple[Request, FinishReason]], list[list[int]]]:
        """Per-row path for steps where some decode rows verified drafts."""
        batch = self.batch
        kv = self.kv_cache_manager
        num_decode = out.num_decode_rows
        b = out.num_rows
        s = len(out.sample_rows)
        if len(result.sampled_token_ids) != s:
            raise ValueError(f"speculative step needs sampled_token_ids for all {s} sampling rows")
        finishing: list[tuple[Request, FinishReason]] = []
        new_token_ids: list[list[int]] = []
        batch.num_computed[num_decode:b] += out.query_lens[num_decode:]
        for row in range(s):
            request = batch.requests[row]
            accepted = result.sampled_token_ids[row]
            drafts = int(out.num_draft_tokens[row])
            if not 1 <= len(accepted) <= drafts + 1:
                raise ValueError(
                    f"row {row} (request {request.req_id}) accepted {len(accepted)} tokens with "
                    f"{drafts} drafts; expected 1..{drafts + 1}"
                )
            if row < num_decode:
                batch.num_computed[row] += len(accepted)
                if drafts:
                    self.spec_stats.record(drafts, len(accepted) - 1)
            kept: list[int] = []
            reason = None
            constrained = out.grammar_bitmask is not None and bool(batch.has_grammar[row])
            for token in accepted:
                request.token_ids.append(token)
                kept.append(token)
                grammar_end = self._accept_grammar(request, token) if constrained else None
                reason = grammar_end or self._stop_reason(request, token, request.num_tokens)
                if reason is not None:
                    break
            batch.num_tokens[row] = request.num_tokens
            batch.last_token[row] = kept[-1]
            batch.last_token_time[row] = now
            new_token_ids.append(kept if len(kept) < len(accepted) else accepted)
            if reason is not None:
                finishing.append((request, reason))
            elif row < num_decode and drafts:
                keep_blocks = kv.blocks_needed(request.num_tokens)
                if batch.num_blocks[row] > keep_blocks:
                    kv.truncate(request.req_id, keep_blocks)
                    batch.truncate_blocks(row, keep_blocks)
        return finishing, new_token_ids

    # -- finishing, preemption, abort -------------------------------------------------------
    def _mark_finished(self, request: Request, reason: FinishReason, message: str | None = None) -> None:
        """Finish `request`: its grammar state is dropped and its blocks freed, unless the KV
        connector leases them (a P/D producer request), then they are freed when the lease ends."""
        if self.structured_output is not None:
            self.structured_output.remove(request.req_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if message is not None:
            request.finish_message = message
        kv = self.kv_cache_manager
        connector = self.kv_connector
        params = (
            None if connector is None else connector.request_finished(request, kv.block_ids(request.req_id))
        )
        if params is None:
            kv.free(request.req_id)
        else:
            request.kv_transfer_params_out = params
            self._held[request.req_id] = request
        self._finished.append(request)
        self._finished_ids.append(request.req_id)

    def _finish_running(self, request: Request, reason: FinishReason) -> None:
        self._remove_row(request)
        del self._unfinished[request.req_id]
        self._mark_finished(request, reason)

    def _preempt(self, request: Request) -> None:
        self._remove_row(request)
        self.kv_cache_manager.free(request.req_id, keep_keys=True)
        self._to_recompute(request)

    def abort(self, req_id: int, message: str | None = None) -> Request | None:
        """Finish a request now (client gone, stop string matched) and free its blocks.

        While a step is in flight a running request is aborted right after that step's
        `postprocess` (its row is part of the step); a P/D consumer whose pull is running is
        aborted once the connector reports the pull stopped writing its blocks. Returns the
        request, or None if unknown.
        """
        request = self._unfinished.get(req_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            if self._in_flight is not None:
                self._pending_aborts.append((req_id, message))
                return request
            self._remove_row(request)
        elif req_id in self._remote_pending:
            if req_id in self._aborted_while_pulling:
                return request  # already aborting: its pull is stopping
            if self.kv_connector is not None and self.kv_connector.abort_pull(request):
                self._aborted_while_pulling[req_id] = message
                return request
            del self._remote_pending[req_id]
        elif request in self._arrived:
            self._arrived.remove(request)
        else:
            self.waiting.remove(request)
        del self._unfinished[req_id]
        self._mark_finished(request, FinishReason.ABORT, message)
        return request

    def take_finished(self) -> list[Request]:
        """Requests finished (rejected, aborted) since the last `postprocess`, for loops that
        had no step to run."""
        finished, self._finished = self._finished, []
        return finished

    # -- P/D --------------------------------------------------------------------------------
    def update_from_kv_connector(self) -> bool:
        """Apply what the KV connector's threads did (pulls that ended, leases that ended);
        `schedule` does it first, an idle engine loop calls it to free ended leases. True if a
        lease's blocks were freed."""
        if self.kv_connector is None:
            return False
        updates = self.kv_connector.take_updates()
        for req_id in updates.pulls_stopped:
            self._pull_stopped(req_id)
        for arrived in updates.arrived:
            self._remote_kv_arrived(arrived)
        for failed in updates.failed:
            self._remote_kv_failed(failed)
        freed = False
        for req_id in updates.leases_ended:
            if self._held.pop(req_id, None) is not None:
                self.kv_cache_manager.free(req_id)
                freed = True
        return freed

    def _reserve_for_remote(self, request: Request) -> bool:
        kv = self.kv_cache_manager
        if kv.num_blocks_of(request.req_id):
            return True
        hits = kv.find_prefix_hits(request)
        if hits is None:
            return False
        self._allocate(request, hits)
        self._remote_pending[request.req_id] = request
        if self.kv_connector is not None:
            self.kv_connector.blocks_reserved(request, kv.block_ids(request.req_id))
        return True

    def _pull_stopped(self, req_id: int) -> None:
        message = self._aborted_while_pulling.pop(req_id, None)
        request = self._remote_pending.pop(req_id, None)
        if request is None:
            return
        del self._unfinished[req_id]
        self._mark_finished(request, FinishReason.ABORT, message)

    def _remote_kv_arrived(self, arrived: RemoteKVArrived) -> None:
        """Consumer: the producer's KV for the first `num_computed_tokens` tokens is in our
        blocks. With `first_token_id` (the producer sampled it) the request continues as a
        decode row; its received full blocks become hittable."""
        req_id = arrived.req_id
        if req_id in self._aborted_while_pulling:
            self._pull_stopped(req_id)
            return
        request = self._remote_pending.get(req_id)
        if request is None:
            raise KeyError(f"request {req_id} is not waiting for remote KV")
        num_computed = arrived.num_computed_tokens
        if not request.num_computed_tokens <= num_computed <= request.num_prompt_tokens:
            raise ValueError(
                f"num_computed_tokens={num_computed} must be within "
                f"[{request.num_computed_tokens}, {request.num_prompt_tokens}]"
            )
        del self._remote_pending[req_id]
        first_token_id = arrived.first_token_id
        if first_token_id is not None:
            request.token_ids.append(first_token_id)
            request.first_token_time = self.clock()
        # At least one token must be computed here to produce logits.
        request.num_computed_tokens = min(num_computed, request.num_tokens - 1)
        self.kv_cache_manager.publish(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        if first_token_id is not None:
            # The grammar continues from the prefill leg's first token.
            reason, message = self._replay_first_token(request, first_token_id)
            reason = reason or self._stop_reason(request, first_token_id, request.num_tokens)
            if reason is not None:
                del self._unfinished[req_id]
                self._mark_finished(request, reason, message)
                return
        self._arrived.append(request)

    def _replay_first_token(self, request: Request, token: int) -> tuple[FinishReason | None, str | None]:
        """A P/D decode leg's grammar takes the token the prefill leg sampled."""
        if self.structured_output is None or request.req_id not in self.structured_output:
            return None, None
        try:
            complete = self.structured_output.accept(request.req_id, [token])
        except GrammarRefusedToken as exc:
            return FinishReason.REJECTED, (
                f"kv_transfer_params: the prefill leg's first {exc} (did both legs get the same "
                "response_format and tools?)"
            )
        return (FinishReason.STOP if complete else None), None

    def _remote_kv_failed(self, failed: RemoteKVFailed) -> None:
        """Consumer: the pull failed. Recompute the prompt locally, or fail the request."""
        req_id = failed.req_id
        if req_id in self._aborted_while_pulling:
            self._pull_stopped(req_id)
            return
        request = self._remote_pending.pop(req_id, None)
        if request is None:
            raise KeyError(f"request {req_id} is not waiting for remote KV")
        self.kv_cache_manager.free(req_id, keep_keys=True)
        request.num_computed_tokens = 0
        if failed.recompute:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            del self._unfinished[req_id]
            self._mark_finished(request, FinishReason.ABORT, failed.message)

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()
