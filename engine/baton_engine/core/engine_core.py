"""The engine core: the step loop (schedule -> run -> postprocess) and per-request outputs.

The core speaks token ids only. Text (tokenizing, detokenizing, stop strings) is the caller's:
the offline `LLM` runs it in-process, the HTTP server in its own process (`core_process`). A
request id is the caller's string (`Request.client_id`); the scheduler's requests get integer
ids here.

Each step: the drafter (speculative decoding) proposes drafts for the decoding requests as data,
the scheduler plans the step with them (applying the KV connector's updates first), the runner
executes it, the scheduler applies the result, and the outputs of every request that gained
tokens or finished are returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from baton_engine.core.engine_stats import EngineStats
from baton_engine.core.kv_connector import KVConnector
from baton_engine.core.outputs import RequestOutput, TokenLogprobs
from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.core.scheduler import Scheduler
from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton_engine.core.scheduler_stats import SpecDecodeStats
from baton_engine.prefix.events import KVCacheEvent

log = logging.getLogger(__name__)

KVEventSink = Callable[[list[KVCacheEvent]], None]
"""Receives the KV-cache events of one step (the KV-event publisher, when enabled)."""


class Runner(Protocol):
    """What the core needs from a model runner."""

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput: ...


class Drafter(Protocol):
    """Speculative decoding: draft tokens for the decoding requests, proposed before each step."""

    def propose(self, requests: Sequence[Request], max_model_len: int) -> dict[int, list[int]]:
        """Drafts by request id for (some of) `requests` (all decoding); valid for one step."""
        ...


class SpecDecodeStatsLogger(Protocol):
    """Reports speculative acceptance now and then (`spec_decode.stats_log.SpecDecodeLogger`)."""

    def maybe_log(self, stats: SpecDecodeStats, now: float) -> bool: ...


@dataclass
class _Tracked:
    """What the engine core keeps per request for its outputs."""

    request: Request
    num_emitted: int = 0
    """Output tokens already returned in earlier `RequestOutput`s."""
    reported_queue_time: bool = False
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Logprobs of tokens not yet returned."""


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        kv_event_sink: KVEventSink | None = None,
        drafter: Drafter | None = None,
        spec_stats_logger: SpecDecodeStatsLogger | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter
        self.spec_stats_logger = spec_stats_logger
        self.kv_event_sink = kv_event_sink
        self._kv_stats_version = 0
        self._kv_leases_reported = 0
        self._requests: dict[int, _Tracked] = {}
        self._ids: dict[str, int] = {}
        # Aborted while a step was in flight: such a request may still finish in that step.
        self._abort_requested: set[str] = set()
        self._next_req_id = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_steps = 0

    @property
    def kv_connector(self) -> KVConnector | None:
        """The P/D connector (the scheduler's), if this engine transfers KV."""
        return self.scheduler.kv_connector

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
        req_id = self._next_req_id
        request = Request(
            req_id, list(prompt_token_ids), params, client_id=request_id, arrival_time=arrival_time
        )
        if kv_transfer_params is not None:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params: this engine does no KV transfer (--kv-role none)")
            self.kv_connector.prepare(request, kv_transfer_params)
        self._next_req_id += 1
        self._requests[req_id] = _Tracked(request)
        self._ids[request_id] = req_id
        self.scheduler.add(request)

    def abort_requests(self, request_ids: Sequence[str], message: str | None = None) -> None:
        """Finish requests now and free their KV; unknown ids are ignored. A finished P/D producer
        request whose blocks are still leased gets its lease released (nobody will pull it: the
        abort means its client, which would have passed the params on, is gone)."""
        for request_id in request_ids:
            req_id = self._ids.get(request_id)
            if req_id is None:
                if self.kv_connector is not None:
                    self.kv_connector.release_request(request_id)
                continue
            self._abort_requested.add(request_id)
            self.scheduler.abort(req_id, message)

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
        connector = self.kv_connector
        if connector is None:
            return False
        freed = self.scheduler.update_from_kv_connector()
        version = connector.stats_version
        changed = (
            freed
            or version != self._kv_stats_version
            or connector.num_leases_held != self._kv_leases_reported
        )
        self._kv_stats_version = version
        return changed

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that gained tokens or finished."""
        sched = self.scheduler
        drafts = None
        if self.drafter is not None:
            drafts = self.drafter.propose(sched.decoding_requests(), sched.max_model_len)
            if self.spec_stats_logger is not None:
                self.spec_stats_logger.maybe_log(sched.spec_stats, time.monotonic())
        out = sched.schedule(drafts)
        touched: dict[int, _Tracked] = {}
        if out.num_rows:
            try:
                result = self.runner.execute(out)
            except BaseException:
                sched.discard_step(out)  # the scheduler stays usable: the next step recomputes these tokens
                raise
            step = sched.postprocess(out, result)
            self._num_steps += 1
            requests = self._requests
            for req_id in step.req_ids:  # (a request's new tokens are read off it in `_output`)
                tracked = requests.get(req_id)
                if tracked is not None:
                    touched[req_id] = tracked
            if step.logprobs is not None:
                for req_id, row_logprobs in zip(step.req_ids, step.logprobs, strict=True):
                    tracked = requests.get(req_id)
                    if tracked is not None and tracked.request.sampling_params.logprobs is not None:
                        tracked.new_logprobs.extend(row_logprobs)
            finished = step.finished
        else:  # an empty step is not in flight: nothing to run or postprocess
            finished = sched.take_finished()
            connector = self.kv_connector
            if connector is not None and connector.busy():
                time.sleep(0.0005)  # only pulls are in flight: leave the GIL to their thread
        for request in finished:
            tracked = self._requests.get(request.req_id)
            if tracked is not None:
                touched[request.req_id] = tracked
        events = sched.kv_cache_manager.take_events()  # drained even unheard: keeps the log bounded
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)
        return [self._output(tracked) for tracked in touched.values()]

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        client_id = request.client_id
        # Sliced off the token list at the first new token: `output_token_ids` would copy the
        # whole output first (per request per step, O(length) each time).
        token_ids, num_prompt = request.token_ids, request.num_prompt_tokens
        new_ids = token_ids[num_prompt + tracked.num_emitted :]
        if tracked.num_emitted == 0 and new_ids:
            self._prompt_tokens += num_prompt
        self._generation_tokens += len(new_ids)
        tracked.num_emitted = len(token_ids) - num_prompt
        running = not request.is_finished
        if running and tracked.reported_queue_time and request.sampling_params.logprobs is None:
            # A running request's new tokens, the path of every row of a decode step: only the
            # fields that differ from their defaults (the full keyword call costs as much again).
            return RequestOutput(
                client_id, new_ids, num_prompt_tokens=num_prompt, num_cached_tokens=request.num_cached_tokens
            )
        queue_time = None
        if not tracked.reported_queue_time and request.first_scheduled_time is not None:
            queue_time = max(0.0, request.first_scheduled_time - request.arrival_time)
            tracked.reported_queue_time = True
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs, tracked.new_logprobs = tracked.new_logprobs, []
        finished = request.is_finished
        kv_params = None
        if finished:
            kv_params = request.kv_transfer_params_out
            if kv_params is not None and client_id in self._abort_requested:
                assert self.kv_connector is not None
                self.kv_connector.release_request(client_id)  # its client is gone
                kv_params = None
            self._abort_requested.discard(client_id)
            del self._requests[request.req_id]
            del self._ids[client_id]
        reason = request.finish_reason.value if finished and request.finish_reason is not None else None
        return RequestOutput(
            request_id=client_id,
            new_token_ids=new_ids,
            finished=finished,
            finish_reason=reason,
            finish_message=request.finish_message if finished else None,
            new_logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_time=queue_time,
            kv_transfer_params=kv_params,
        )

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        sched = self.scheduler.stats()
        connector = self.kv_connector
        leases_held = self._kv_leases_reported = 0 if connector is None else connector.num_leases_held
        return EngineStats(
            num_waiting=sched.num_waiting,
            num_running=sched.num_running,
            kv_usage=sched.kv_cache_usage,
            num_kv_blocks=sched.num_kv_blocks,
            num_used_kv_blocks=sched.num_used_kv_blocks,
            prefix_queried_tokens=sched.prefix_queried_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            spec_draft_tokens=sched.spec_draft_tokens,
            spec_accepted_tokens=sched.spec_accepted_tokens,
            spec_num_drafts=sched.spec_num_drafts,
            spec_accepted_per_position=sched.spec_accepted_per_position,
            num_steps=self._num_steps,
            kv_transfer=None if connector is None else connector.stats_totals(),
            kv_leases_held=leases_held,
            num_grammar_requests=sched.num_grammar_requests,
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
