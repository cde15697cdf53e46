"""The engine core: the step loop (schedule -> run -> postprocess) and per-request outputs.

The core speaks token ids only. Text (tokenizing, detokenizing, stop strings) is the caller's:
the offline `LLM` runs it in-process, the HTTP server in its own process (`core_process`). A
request id is the caller's string; the scheduler's sequences get integer ids here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from baton_engine.core.engine_stats import EngineStats
from baton_engine.core.outputs import RequestOutput, TokenLogprobs
from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.prefix.events import KVCacheEvent

if TYPE_CHECKING:
    from baton_engine.kv_transfer.connector import KVTransferConnector

log = logging.getLogger(__name__)

KVEventSink = Callable[[list[KVCacheEvent]], None]
"""Receives the KV-cache events of one step (the KV-event publisher, when enabled)."""


class Runner(Protocol):
    """What the core needs from a model runner."""

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput: ...


class Drafter(Protocol):
    """Speculative decoding: sets the decoding sequences' drafts before each schedule."""

    def before_schedule(self, scheduler: Scheduler) -> None: ...


@dataclass
class _Request:
    request_id: str
    seq: Request
    num_emitted: int = 0
    reported_queue_time: bool = False
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        kv_event_sink: KVEventSink | None = None,
        drafter: Drafter | None = None,
        kv_connector: KVTransferConnector | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter
        self.kv_event_sink = kv_event_sink
        self.kv_connector = kv_connector
        self._kv_stats_version = 0
        self._kv_leases_reported = 0
        self._requests: dict[int, _Request] = {}
        self._ids: dict[str, int] = {}
        # Aborted while a step was in flight: such a request may still finish in that step.
        self._abort_requested: set[str] = set()
        self._next_seq_id = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_steps = 0

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request. A request that can never fit is finished as ``rejected`` in the next
        `step` (with the reason in `RequestOutput.finish_message`). `kv_transfer_params`: a P/D
        leg (``{"do_remote_decode": true}`` on a producer, signed params on a consumer); bad
        params raise ValueError."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq_id = self._next_seq_id
        seq = Request(seq_id, list(prompt_token_ids), params, arrival_time=arrival_time)
        if kv_transfer_params is not None:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params: this engine does no KV transfer (--kv-role none)")
            self.kv_connector.prepare(seq, kv_transfer_params)
        self._next_seq_id += 1
        self._requests[seq_id] = _Request(request_id, seq)
        self._ids[request_id] = seq_id
        self.scheduler.add(seq)

    def abort_requests(self, request_ids: Sequence[str], message: str | None = None) -> None:
        """Finish requests now and free their KV; unknown ids are ignored. A finished P/D producer
        request whose blocks are still leased gets its lease released (nobody will pull it: the
        abort means its client, which would have passed the params on, is gone)."""
        for request_id in request_ids:
            seq_id = self._ids.get(request_id)
            if seq_id is None:
                if self.kv_connector is not None:
                    self.kv_connector.release_request(request_id)
                continue
            self._abort_requested.add(request_id)
            if self.kv_connector is not None and self.kv_connector.abort(seq_id, message):
                continue  # its KV pull is stopping; the connector aborts it once it has
            self.scheduler.abort(seq_id, message)

    def release_transfer(self, engine_id: str, transfer_id: str) -> bool:
        """Producer: end lease `transfer_id` early if this engine (`engine_id`) holds it; its
        blocks are freed on the next step or idle poll. False if there is no such lease."""
        return self.kv_connector is not None and self.kv_connector.release_transfer(engine_id, transfer_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.scheduler.has_unfinished()

    def poll_kv_transfer(self) -> bool:
        """Free the blocks of ended producer leases while idle (`step` does it when busy).
        True if blocks were freed or transfer stats changed since the last poll (worth a stats
        push: a stats call between a lease's end and its free saw no lease but the blocks used)."""
        if self.kv_connector is None:
            return False
        freed = self.kv_connector.before_step()
        version = self.kv_connector.stats.version
        changed = (
            freed or version != self._kv_stats_version or self._leases_held() != self._kv_leases_reported
        )
        self._kv_stats_version = version
        return changed

    def _leases_held(self) -> int:
        producer = None if self.kv_connector is None else self.kv_connector.producer
        return 0 if producer is None else len(producer.leases)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that gained tokens or finished."""
        sched = self.scheduler
        if self.kv_connector is not None:
            self.kv_connector.before_step()
        if self.drafter is not None:
            self.drafter.before_schedule(sched)
        out = sched.schedule()
        if self.kv_connector is not None:
            self.kv_connector.after_schedule()
        touched: dict[int, _Request] = {}
        if out.num_rows:
            try:
                result = self.runner.execute(out)
            except BaseException:
                sched.discard_step(out)  # the scheduler stays usable: the next step recomputes these tokens
                raise
            step = sched.postprocess(out, result)
            self._num_steps += 1
            logprobs = result.logprobs
            for i, (seq_id, tokens) in enumerate(zip(step.seq_ids, step.new_token_ids, strict=True)):
                req = self._requests.get(seq_id)
                if req is None:
                    continue
                touched[seq_id] = req
                if logprobs is not None and req.seq.sampling_params.logprobs is not None:
                    req.new_logprobs.extend(logprobs[i][: len(tokens)])
            finished = step.finished
        else:  # an empty step is not in flight: nothing to run or postprocess
            finished = sched.take_finished()
            if self.kv_connector is not None and self.kv_connector.busy():
                time.sleep(0.0005)  # only pulls are in flight: leave the GIL to their thread
        for seq in finished:
            req = self._requests.get(seq.seq_id)
            if req is not None:
                touched[seq.seq_id] = req
        if self.kv_event_sink is not None:
            events = sched.block_manager.take_events()
            if events:
                self.kv_event_sink(events)
        else:
            sched.block_manager.take_events()  # keep the log bounded when nobody listens
        return [self._output(req) for req in touched.values()]

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        output_ids = seq.output_token_ids
        new_ids = output_ids[req.num_emitted :]
        if req.num_emitted == 0 and new_ids:
            self._prompt_tokens += seq.num_prompt_tokens
        self._generation_tokens += len(new_ids)
        req.num_emitted = len(output_ids)
        queue_time = None
        if not req.reported_queue_time and seq.first_scheduled_time is not None:
            queue_time = max(0.0, seq.first_scheduled_time - seq.arrival_time)
            req.reported_queue_time = True
        logprobs = None
        if seq.sampling_params.logprobs is not None:
            logprobs, req.new_logprobs = req.new_logprobs, []
        finished = seq.is_finished
        kv_params = None
        if finished:
            if self.kv_connector is not None:
                kv_params = self.kv_connector.producer_finished(seq, req.request_id)
                if kv_params is not None and req.request_id in self._abort_requested:
                    self.kv_connector.release_request(req.request_id)  # its client is gone
                    kv_params = None
            self._abort_requested.discard(req.request_id)
            del self._requests[seq.seq_id]
            del self._ids[req.request_id]
        reason = seq.finish_reason.value if finished and seq.finish_reason is not None else None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            finished=finished,
            finish_reason=reason,
            finish_message=seq.finish_message if finished else None,
            new_logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            queue_time=queue_time,
            kv_transfer_params=kv_params,
        )

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        sched = self.scheduler
        bm = sched.block_manager
        prefix = sched.prefix_cache_stats
        spec = sched.spec_stats
        leases_held = self._kv_leases_reported = self._leases_held()
        return EngineStats(
            num_waiting=sched.num_waiting,
            num_running=sched.num_running,
            kv_usage=bm.usage(),
            num_kv_blocks=bm.num_blocks,
            num_used_kv_blocks=bm.num_used_blocks,
            prefix_queried_tokens=prefix.queried_tokens,
            prefix_hit_tokens=prefix.hit_tokens,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_num_drafts=spec.num_forwards,
            spec_accepted_per_position=list(spec.accepted_per_position),
            num_steps=self._num_steps,
            kv_transfer=None if self.kv_connector is None else self.kv_connector.stats.totals().to_dict(),
            kv_leases_held=leases_held,
            num_grammar_requests=len(sched.structured_output or ()),
        )


def run_until_idle(core: EngineCore, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
    """Step until no request is left (the offline path's loop)."""
    while core.has_unfinished():
        started = time.monotonic()
        outputs = core.step()
        if outputs:
            on_outputs(outputs)
        elif time.monotonic() - started < 1e-4:
            time.sleep(0.001)  # nothing schedulable yet (e.g. waiting for remote KV)
