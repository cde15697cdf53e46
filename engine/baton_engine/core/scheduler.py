"""The scheduler: which sequences run each step, how many tokens each, and what happens after.

Each step is a *mixed* batch: every decoding sequence gets exactly one token (1 + K with K
drafts), then the rest of the token budget goes to prefills — first sequences already
prefilling (chunked prefill), then new admissions from the waiting queue (FIFO). When a decode
step cannot get a block, the most recently admitted running sequence is preempted: its blocks
are freed and it re-enters the waiting queue to recompute its KV later (its tokens are kept, so
its output does not change). Requests that can never fit are finished with a rejection reason.

Engine loop::

    out = scheduler.schedule()
    if out.num_rows:
        result = runner.run(out)
        step = scheduler.postprocess(out, result)
    events = scheduler.block_manager.take_events()

The decode path is vectorised over the persistent batch (`BatchState`); per-sequence Python
work happens only for rows that cross a block boundary, finish, or change state — and for rows
that follow a grammar (structured output): the scheduler drives the `StructuredOutputManager`
(a request's grammar is added when it is queued, its drafts are cut to what the grammar allows,
each step carries the bitmasks of its constrained positions, kept tokens are accepted, and a
request whose grammar is complete finishes with ``stop``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from baton_engine.core.batch import BatchState
from baton_engine.core.kv_cache_manager import BlockManager
from baton_engine.core.request import FinishReason, Request, RequestStatus
from baton_engine.core.scheduler_output import Int64Array, ModelRunnerOutput, SchedulerOutput
from baton_engine.core.scheduler_stats import PrefixCacheStats, SpecDecodeStats
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
    seq_ids: list[int]
    """Sequences that gained tokens this step (the sampling rows, in row order)."""
    new_token_ids: list[list[int]]
    """Tokens appended to each of `seq_ids` (a speculative run is cut after a stop token)."""
    logprobs: list[list[list[tuple[int, float]]]] | None = None
    """The runner's logprobs, aligned with `new_token_ids` (cut the same way); None if none."""
    finished: list[Request] = field(default_factory=list)
    """Sequences finished since the previous `postprocess`: stopped here, or rejected or aborted
    in between."""
    timestamp: float = 0.0
    """Clock reading when the tokens were appended (their arrival time for ITL)."""


@dataclass
class _HeldTransfer:
    seq: Request
    expires_at: float


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
        kv_lease_seconds: float = 30.0,
        prefix_hasher: PrefixHasher = fast_prefix_hash,
        enable_kv_events: bool = True,
        structured_output: StructuredOutputManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`structured_output`: follows the grammars of requests that have one (None: such
        requests are rejected, e.g. for a model without a tokenizer)."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                f"({max_num_seqs}) so that every running sequence can decode in every step"
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
        self.kv_lease_seconds = kv_lease_seconds
        self.structured_output = structured_output
        self.clock = clock

        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            hasher=prefix_hasher,
            record_events=enable_kv_events,
        )
        max_blocks_per_seq = -(-(max_model_len + num_speculative_tokens + 1) // block_size)
        self.batch = BatchState(max_num_seqs, max_blocks_per_seq)

        self.waiting: deque[Request] = deque()
        self._admitted: dict[int, Request] = {}  # running sequences in admission order
        self._unfinished: dict[int, Request] = {}
        self._remote_pending: dict[int, Request] = {}  # blocks reserved, KV being pulled
        self._new_remote_reservations: list[Request] = []
        self._held: dict[str, _HeldTransfer] = {}
        self._finished: list[Request] = []  # since the last postprocess
        self._finished_ids: list[int] = []  # since the last schedule
        self._stop_id_rows = 0  # running rows whose params have stop_token_ids
        self._stop_id_union: Int64Array = np.zeros(0, dtype=np.int64)

        self._step_id = 0
        self._in_flight: SchedulerOutput | None = None
        self._pending_aborts: list[int] = []

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
        structured_output: StructuredOutputManager | None = None,
        clock: Callable[[], float] = time.monotonic,
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
            kv_lease_seconds=config.kv_lease_seconds,
            prefix_hasher=prefix_hasher,
            enable_kv_events=config.kv_events,
            structured_output=structured_output,
            clock=clock,
        )

    # -- queue inspection -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._remote_pending)

    @property
    def num_running(self) -> int:
        return self.batch.num_rows

    @property
    def num_held_transfers(self) -> int:
        return len(self._held)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._finished)

    def get(self, seq_id: int) -> Request | None:
        return self._unfinished.get(seq_id)

    def stats(self) -> dict[str, float]:
        """A snapshot for metrics (queue depth, running, KV usage, cache and speculation)."""
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "kv_cache_usage": self.block_manager.usage(),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix_cache_stats.queried_tokens,
            "prefix_cache_hits": self.prefix_cache_stats.hit_tokens,
            "spec_draft_tokens": self.spec_stats.num_draft_tokens,
            "spec_accepted_tokens": self.spec_stats.num_accepted_tokens,
        }

    # -- admission --------------------------------------------------------------------------
    def rejection_reason(self, seq: Request) -> str | None:
        """Why `seq` can never be (re)computed with this configuration, or None."""
        n = seq.num_tokens
        what = "prompt" if seq.num_output_tokens == 0 else "prompt + output"
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
        needed = self.block_manager.blocks_needed(n)
        if needed > self.block_manager.num_blocks:
            return (
                f"{what} needs {needed} KV blocks, more than the whole pool "
                f"({self.block_manager.num_blocks} blocks of {self.block_size} tokens)"
            )
        return None

    def add(self, seq: Request) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_REMOTE_KV on a P/D consumer).

        A request that can never fit is finished at once with reason REJECTED; it is reported in
        the next `postprocess` / `take_finished`.
        """
        if seq.seq_id in self._unfinished:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        if seq.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV):
            raise ValueError(f"sequence {seq.seq_id} has status {seq.status.value}, expected waiting")
        reason = self.rejection_reason(seq) or self._add_grammar(seq)
        if reason is not None:
            self._mark_finished(seq, FinishReason.REJECTED, reason)
            return
        self._unfinished[seq.seq_id] = seq
        self.waiting.append(seq)

    def _add_grammar(self, seq: Request) -> str | None:
        """Start following `seq`'s grammar, if it has one; why it cannot be followed, or None."""
        grammar = seq.sampling_params.grammar
        if grammar is None:
            return None
        if self.structured_output is None:
            return "grammar: this engine cannot follow grammars (its model has no tokenizer)"
        try:
            self.structured_output.add(seq.seq_id, grammar)
        except StructuredOutputError as exc:
            return str(exc)  # "grammar: ..." (the server names the request field it came from)
        return None

    @property
    def _grammars(self) -> StructuredOutputManager | None:
        """The manager while it follows any request (steps without one skip all grammar work)."""
        manager = self.structured_output
        return manager if manager is not None and len(manager) else None

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. Unless it is empty, call `postprocess` with its result
        before the next call."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before postprocess() of the previous step")
        now = self.clock()
        self._step_id += 1
        batch = self.batch
        budget = self.max_num_batched_tokens

        # 1. Every decode row gets its token(s); find blocks for them, preempting if needed.
        if self.num_speculative_tokens:
            self._plan_drafts(budget)
        preemptions_before = self.num_preemptions
        self._grow_decode_blocks()
        preempted = self.num_preemptions != preemptions_before
        num_decode = batch.num_decode
        num_decode_tokens = num_decode
        if self.num_speculative_tokens and num_decode:
            num_decode_tokens += int(batch.num_drafts[:num_decode].sum())
        budget -= num_decode_tokens

        # 2. Sequences already prefilling continue, in order, while the budget lasts.
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
        if budget > 0 and all_prefills_served and self.waiting and delay_passed and not preempted:
            budget = self._admit(budget, chunks, now)

        out = self._build_output(num_decode, chunks)
        # An empty step has nothing to run or postprocess (report finishes via take_finished).
        self._in_flight = out if out.num_rows else None
        return out

    def _plan_drafts(self, budget: int) -> None:
        batch = self.batch
        k = self.num_speculative_tokens
        room = budget - batch.num_decode
        grammars = self._grammars
        for row in range(batch.num_decode):
            seq = batch.seqs[row]
            if grammars is not None and batch.has_grammar[row] and seq.draft_token_ids:
                seq.draft_token_ids = grammars.cut_drafts(seq.seq_id, seq.draft_token_ids)
            wanted = min(len(seq.draft_token_ids), k, self.max_model_len - seq.num_tokens, room)
            wanted = max(wanted, 0)
            batch.num_drafts[row] = wanted
            room -= wanted

    def _grow_decode_blocks(self) -> None:
        batch = self.batch
        bm = self.block_manager
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
            if bm.num_free_blocks >= len(short_rows) and (missing_blocks == 1).all():
                # Common case: each short row needs exactly one block and the pool has them.
                new_blocks = bm.take_blocks(len(short_rows))
                batch.block_table[short_rows, batch.num_blocks[short_rows]] = new_blocks
                batch.num_blocks[short_rows] += 1
                seqs = batch.seqs
                for row, block_id in zip(short_rows.tolist(), new_blocks, strict=True):
                    seqs[row].block_table.append(block_id)
                return
            preempted = False
            for row in short_rows.tolist():
                missing = int(needed_blocks[row] - batch.num_blocks[row])
                if bm.num_free_blocks < missing and batch.num_drafts[row]:
                    # Drop this row's drafts before preempting anyone for them.
                    batch.num_drafts[row] = 0
                    missing = int((batch.num_computed[row] + bs) // bs - batch.num_blocks[row])
                    if missing <= 0:
                        continue
                if bm.num_free_blocks >= missing:
                    seq = batch.seqs[row]
                    new_blocks = bm.take_blocks(missing)
                    seq.block_table.extend(new_blocks)
                    batch.append_blocks(row, new_blocks)
                    continue
                self._preempt(next(reversed(self._admitted.values())))
                preempted = True
                break
            if not preempted:
                return

    def _admit(self, budget: int, chunks: list[int], now: float) -> int:
        batch = self.batch
        bm = self.block_manager
        skipped: list[Request] = []
        admitted_any = False
        while self.waiting and budget > 0 and batch.num_rows < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                self.waiting.popleft()
                if not self._reserve_for_remote(seq):
                    skipped.append(seq)
                continue
            reason = None if seq.block_table else self.rejection_reason(seq)
            if reason is not None:
                # Only a preempted sequence that grew past what can ever be recomputed gets here
                # with output: it ends as if it hit a length limit.
                self.waiting.popleft()
                del self._unfinished[seq.seq_id]
                if seq.num_output_tokens:
                    self._mark_finished(seq, FinishReason.LENGTH, f"cannot resume after preemption: {reason}")
                else:
                    self._mark_finished(seq, FinishReason.REJECTED, reason)
                continue
            if seq.block_table:
                # KV arrived from a producer: blocks are there, the rest is computed normally.
                missing = bm.blocks_needed(seq.num_tokens) - len(seq.block_table)
                if missing > bm.num_free_blocks:
                    break
                num_new = seq.num_tokens - seq.num_computed_tokens
                if not self.enable_chunked_prefill and num_new > budget:
                    break
                bm.append_slots(seq, seq.num_tokens)
            else:
                hits = bm.can_allocate(seq)
                if hits < 0:
                    break
                num_new = seq.num_tokens - hits * self.block_size
                if not self.enable_chunked_prefill and num_new > budget:
                    break
                bm.allocate(seq, hits)
                self.prefix_cache_stats.record(seq.num_tokens, seq.num_cached_tokens)
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self._admitted[seq.seq_id] = seq
            self._add_row(seq)
            chunk = min(num_new, budget)
            chunks.append(chunk)
            budget -= chunk
            admitted_any = True
        if skipped:
            self.waiting.extend(skipped)
        if admitted_any:
            self._prev_prompt = True
        return budget

    def _passed_delay(self, now: float) -> bool:
        # Hold new prompts until the oldest has waited delay_factor x the last prompt step's
        # latency, so arrivals batch up (never while nothing is running).
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if not self.waiting or not self._admitted:
            return True
        earliest = min(seq.arrival_time for seq in self.waiting)
        return (now - earliest) > self.delay_factor * self._last_prompt_latency

    def _add_row(self, seq: Request) -> None:
        self.batch.add_row(seq, self.eos_token_id, self.max_model_len)
        if seq.sampling_params.stop_token_ids:
            self._stop_id_rows += 1
            union = set(self._stop_id_union.tolist()) | set(seq.sampling_params.stop_token_ids)
            self._stop_id_union = np.array(sorted(union), dtype=np.int64)

    def _remove_row(self, seq: Request) -> None:
        self.batch.release_row(seq)
        del self._admitted[seq.seq_id]
        if seq.sampling_params.stop_token_ids:
            self._stop_id_rows -= 1
            if self._stop_id_rows == 0:
                self._stop_id_union = np.zeros(0, dtype=np.int64)

    def _build_output(self, num_decode: int, chunks: list[int]) -> SchedulerOutput:
        finished_ids, self._finished_ids = self._finished_ids, []
        out = build_step(
            self.batch,
            step_id=self._step_id,
            num_decode=num_decode,
            chunks=chunks,
            block_size=self.block_size,
            speculative=bool(self.num_speculative_tokens),
            finished_seq_ids=finished_ids,
        )
        grammars = self._grammars
        if grammars is not None:
            self._attach_bitmask(out, grammars)
        return out

    def _attach_bitmask(self, out: SchedulerOutput, grammars: StructuredOutputManager) -> None:
        """The bitmasks of the step's constrained sampled positions (`grammar_bitmask`)."""
        batch = self.batch
        num_sample = len(out.sample_rows)
        constrained = np.flatnonzero(batch.has_grammar[:num_sample]).tolist()
        if not constrained:
            return
        counts = 1 + out.num_draft_tokens[:num_sample].astype(np.int64)
        first_logits_row = (np.cumsum(counts) - counts).tolist()
        rows = []
        for row in constrained:
            seq = batch.seqs[row]
            drafts = tuple(seq.draft_token_ids[: int(out.num_draft_tokens[row])])
            rows.append(SampledRow(seq.seq_id, first_logits_row[row], drafts))
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
        prefill_rows = batch.seqs[num_decode:b]
        completing = batch.seqs[num_decode:num_sample]
        if out.num_decode_tokens > num_decode:
            finishing, new_token_ids = self._apply_speculative(out, result, now)
        else:
            finishing, new_token_ids = self._apply_tokens(out, result, now)
            if self.num_speculative_tokens:
                for seq in batch.seqs[:num_decode]:
                    seq.draft_token_ids = []  # drafts are for one position only

        bm = self.block_manager
        if bm.enable_prefix_caching:
            computed = batch.num_computed
            if out.num_decode_tokens > num_decode:
                for row in range(num_decode):
                    bm.publish(batch.seqs[row], int(computed[row]))
            else:
                crossed = np.flatnonzero(computed[:num_decode] % self.block_size == 0).tolist()
                seqs = batch.seqs
                bm.publish_next_block([seqs[row] for row in crossed])
            for seq in prefill_rows:
                bm.publish(seq, int(computed[seq._row]))

        for seq in completing:
            if seq.first_token_time is None:
                seq.first_token_time = now
        for seq, reason in finishing:
            self._finish_running(seq, reason, now)
        for seq in completing:
            if seq.status is RequestStatus.RUNNING:
                batch.promote_to_decode(seq)
        for seq_id in self._pending_aborts:
            self.abort(seq_id)
        self._pending_aborts.clear()

        finished, self._finished = self._finished, []
        return StepResult(
            step_id=out.step_id,
            seq_ids=out.seq_ids[:num_sample],
            new_token_ids=new_token_ids,
            logprobs=self._align_logprobs(result, new_token_ids),
            finished=finished,
            timestamp=now,
        )

    @staticmethod
    def _align_logprobs(
        result: ModelRunnerOutput, new_token_ids: list[list[int]]
    ) -> list[list[list[tuple[int, float]]]] | None:
        if result.logprobs is None:
            return None
        if len(result.logprobs) != len(new_token_ids):
            raise ValueError(
                f"runner returned logprobs for {len(result.logprobs)} rows, expected {len(new_token_ids)}"
            )
        return [
            row if len(row) == len(tokens) else row[: len(tokens)]
            for row, tokens in zip(result.logprobs, new_token_ids, strict=True)
        ]

    def discard_step(self, out: SchedulerOutput) -> None:
        """Forget step `out` without applying it (the forward failed): nothing it computed counts,
        so the next step recomputes the same tokens. Aborts requested meanwhile are applied."""
        if self._in_flight is not out:
            raise RuntimeError(f"step {out.step_id} is not the step in flight")
        self._in_flight = None
        for seq_id in self._pending_aborts:
            self.abort(seq_id)
        self._pending_aborts.clear()

    def _apply_tokens(
        self, out: SchedulerOutput, result: ModelRunnerOutput, now: float
    ) -> tuple[list[tuple[Request, FinishReason]], list[list[int]]]:
        """Vectorised path: every sampling row gained exactly one token."""
        batch = self.batch
        b = out.num_rows
        s = len(out.sample_rows)
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
        if lists is None:
            lists = [[t] for t in token_list]

        stop = (tokens == batch.eos[:s]) | (batch.num_tokens[:s] >= batch.stop_len[:s])
        if self._stop_id_rows:
            stop |= np.isin(tokens, self._stop_id_union) & batch.has_stop_ids[:s]
        grammar_ends: dict[int, FinishReason] = {}
        if out.grammar_bitmask is not None:
            for row in np.flatnonzero(batch.has_grammar[:s]).tolist():
                end = self._accept_grammar(batch.seqs[row], token_list[row])
                if end is not None:
                    grammar_ends[row] = end
                    stop[row] = True
        finishing: list[tuple[Request, FinishReason]] = []
        for row in np.flatnonzero(stop).tolist():
            seq = batch.seqs[row]
            reason = grammar_ends.get(row) or self._stop_reason(seq, token_list[row], seq.num_tokens)
            if reason is not None:
                finishing.append((seq, reason))
        return finishing, lists

    def _accept_grammar(self, seq: Request, token: int) -> FinishReason | None:
        """Advance `seq`'s grammar by its new `token`: STOP once the grammar is complete."""
        if self.structured_output is None or seq.seq_id not in self.structured_output:
            return None
        try:
            complete = self.structured_output.accept(seq.seq_id, [token])
        except GrammarRefusedToken as exc:
            # The step's mask allowed only grammar tokens: this is a bug, and it ends this
            # request only (never the step loop).
            log.error("sequence %d: sampled %s; aborting it", seq.seq_id, exc)
            seq.finish_message = f"structured output failed: sampled {exc}"
            return FinishReason.ABORT
        return FinishReason.STOP if complete else None

    def _stop_reason(self, seq: Request, token: int, num_tokens: int) -> FinishReason | None:
        params = seq.sampling_params
        if token == self.eos_token_id and not params.ignore_eos:
            seq.stop_token_id = token
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_token_id = token
            return FinishReason.STOP
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _apply_speculative(
        self, out: SchedulerOutput, result: ModelRunnerOutput, now: float
    ) -> tuple[list[tuple[Request, FinishReason]], list[list[int]]]:
        """Per-row path for steps where some decode rows verified drafts."""
        batch = self.batch
        bm = self.block_manager
        num_decode = out.num_decode_rows
        b = out.num_rows
        s = len(out.sample_rows)
        if len(result.sampled_token_ids) != s:
            raise ValueError(f"speculative step needs sampled_token_ids for all {s} sampling rows")
        finishing: list[tuple[Request, FinishReason]] = []
        new_token_ids: list[list[int]] = []
        batch.num_computed[num_decode:b] += out.query_lens[num_decode:]
        for row in range(s):
            seq = batch.seqs[row]
            accepted = result.sampled_token_ids[row]
            drafts = int(out.num_draft_tokens[row])
            if not 1 <= len(accepted) <= drafts + 1:
                raise ValueError(
                    f"row {row} (sequence {seq.seq_id}) accepted {len(accepted)} tokens with "
                    f"{drafts} drafts; expected 1..{drafts + 1}"
                )
            if row < num_decode:
                batch.num_computed[row] += len(accepted)
                if drafts:
                    self.spec_stats.record(drafts, len(accepted) - 1)
                seq.draft_token_ids = []
            kept: list[int] = []
            reason = None
            constrained = out.grammar_bitmask is not None and bool(batch.has_grammar[row])
            for token in accepted:
                seq.token_ids.append(token)
                kept.append(token)
                grammar_end = self._accept_grammar(seq, token) if constrained else None
                reason = grammar_end or self._stop_reason(seq, token, seq.num_tokens)
                if reason is not None:
                    break
            batch.num_tokens[row] = seq.num_tokens
            batch.last_token[row] = kept[-1]
            batch.last_token_time[row] = now
            new_token_ids.append(kept if len(kept) < len(accepted) else accepted)
            if reason is not None:
                finishing.append((seq, reason))
            elif row < num_decode and drafts:
                keep_blocks = bm.blocks_needed(seq.num_tokens)
                if len(seq.block_table) > keep_blocks:
                    bm.truncate(seq, keep_blocks)
                    batch.truncate_blocks(row, keep_blocks)
        return finishing, new_token_ids

    # -- finishing, preemption, abort -------------------------------------------------------
    def _mark_finished(self, seq: Request, reason: FinishReason, message: str | None = None) -> None:
        if self.structured_output is not None:
            self.structured_output.remove(seq.seq_id)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        if message is not None:
            seq.finish_message = message
        self._finished.append(seq)
        self._finished_ids.append(seq.seq_id)

    def _finish_running(self, seq: Request, reason: FinishReason, now: float) -> None:
        self._remove_row(seq)
        del self._unfinished[seq.seq_id]
        transfer_id = seq.hold_blocks_for_transfer
        if transfer_id is not None and reason is not FinishReason.ABORT:
            self._held[transfer_id] = _HeldTransfer(seq, now + self.kv_lease_seconds)
        else:
            self.block_manager.free(seq)
        self._mark_finished(seq, reason)

    def _preempt(self, seq: Request) -> None:
        self._remove_row(seq)
        self.block_manager.free(seq)
        seq.status = RequestStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def abort(self, seq_id: int, message: str | None = None) -> Request | None:
        """Finish a request now (client gone, stop string matched) and free its blocks.

        While a step is in flight a running sequence is aborted right after that step's
        `postprocess` (its row is part of the step). Returns the sequence, or None if unknown.
        """
        seq = self._unfinished.get(seq_id)
        if seq is None:
            return None
        if seq.status is RequestStatus.RUNNING:
            if self._in_flight is not None:
                self._pending_aborts.append(seq_id)
                return seq
            self._remove_row(seq)
            self.block_manager.free(seq)
        elif seq_id in self._remote_pending:
            del self._remote_pending[seq_id]
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
            self.block_manager.free(seq)  # KV may already have arrived from a producer
        del self._unfinished[seq_id]
        self._mark_finished(seq, FinishReason.ABORT, message)
        return seq

    def take_finished(self) -> list[Request]:
        """Sequences finished (rejected, aborted) since the last `postprocess`, for loops that
        had no step to run."""
        finished, self._finished = self._finished, []
        return finished

    # -- P/D: consumer ----------------------------------------------------------------------
    def _reserve_for_remote(self, seq: Request) -> bool:
        if seq.block_table:
            return True
        hits = self.block_manager.can_allocate(seq)
        if hits < 0:
            return False
        self.block_manager.allocate(seq, hits)
        self.prefix_cache_stats.record(seq.num_tokens, seq.num_cached_tokens)
        self._remote_pending[seq.seq_id] = seq
        self._new_remote_reservations.append(seq)
        return True

    def take_remote_kv_reservations(self) -> list[Request]:
        """Consumer: sequences whose blocks were reserved since the last call. Pull the KV of
        their prompt into ``block_table`` from token ``num_computed_tokens`` (the local prefix
        hit) on, then call `mark_remote_kv_arrived` (or `mark_remote_kv_failed`)."""
        reserved, self._new_remote_reservations = self._new_remote_reservations, []
        return reserved

    def mark_remote_kv_arrived(
        self, seq_id: int, num_computed_tokens: int, first_token_id: int | None = None
    ) -> None:
        """Consumer: the producer's KV for the first `num_computed_tokens` tokens is in our blocks.

        With `first_token_id` (the producer sampled it) the sequence continues as a decode row;
        its received full blocks become hittable.
        """
        seq = self._remote_pending.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not waiting for remote KV")
        if not seq.num_computed_tokens <= num_computed_tokens <= seq.num_prompt_tokens:
            self._remote_pending[seq_id] = seq
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must be within "
                f"[{seq.num_computed_tokens}, {seq.num_prompt_tokens}]"
            )
        if first_token_id is not None:
            seq.token_ids.append(first_token_id)
            seq.first_token_time = self.clock()
        # At least one token must be computed here to produce logits.
        seq.num_computed_tokens = min(num_computed_tokens, seq.num_tokens - 1)
        self.block_manager.publish(seq, seq.num_computed_tokens)
        seq.status = RequestStatus.WAITING
        if first_token_id is not None:
            # The grammar continues from the prefill leg's first token.
            reason, message = self._replay_first_token(seq, first_token_id)
            reason = reason or self._stop_reason(seq, first_token_id, seq.num_tokens)
            if reason is not None:
                del self._unfinished[seq_id]
                self.block_manager.free(seq)
                self._mark_finished(seq, reason, message)
                return
        self.waiting.appendleft(seq)

    def _replay_first_token(self, seq: Request, token: int) -> tuple[FinishReason | None, str | None]:
        """A P/D decode leg's grammar takes the token the prefill leg sampled."""
        if self.structured_output is None or seq.seq_id not in self.structured_output:
            return None, None
        try:
            complete = self.structured_output.accept(seq.seq_id, [token])
        except GrammarRefusedToken as exc:
            return FinishReason.REJECTED, (
                f"kv_transfer_params: the prefill leg's first {exc} (did both legs get the same "
                "response_format and tools?)"
            )
        return (FinishReason.STOP if complete else None), None

    def mark_remote_kv_failed(self, seq_id: int, *, recompute: bool = True) -> None:
        """Consumer: the pull failed. Recompute the prompt locally, or fail the request."""
        seq = self._remote_pending.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not waiting for remote KV")
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        if recompute:
            seq.status = RequestStatus.WAITING
            self.waiting.appendleft(seq)
        else:
            del self._unfinished[seq_id]
            self._mark_finished(seq, FinishReason.ABORT, "KV transfer from the prefill pod failed")

    # -- P/D: producer ----------------------------------------------------------------------
    def release(self, transfer_id: str) -> bool:
        """Producer: the consumer pulled transfer `transfer_id`; free its blocks."""
        held = self._held.pop(transfer_id, None)
        if held is None:
            return False
        self.block_manager.free(held.seq)
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Producer: free held blocks whose lease ran out; returns the expired transfer ids."""
        now = self.clock() if now is None else now
        expired = [tid for tid, held in self._held.items() if held.expires_at <= now]
        for transfer_id in expired:
            self.block_manager.free(self._held.pop(transfer_id).seq)
        return expired

    def held_blocks(self, transfer_id: str) -> list[int] | None:
        held = self._held.get(transfer_id)
        return None if held is None else list(held.seq.block_table)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()
