"""One HTTP request's generation: its choices (prompts x n) in the core, as text deltas.

Each choice is one engine request (``<request id>-<n>-<choice index>``). Text is detokenized
here (`IncrementalDetokenizer`, which also matches stop strings); a matched stop string
aborts that choice in the core. Leaving the iterator early (client disconnect, deadline,
error) aborts every unfinished choice, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from baton_engine.core.outputs import RequestOutput, TokenLogprobs
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.server.engine_client import EngineClient, EngineDeadError
from baton_engine.server.metrics import EngineMetrics
from baton_engine.text.detokenizer import IncrementalDetokenizer
from baton_engine.text.tokenizer import Tokenizer

_engine_ids = itertools.count()


class DeadlineExceeded(Exception):
    pass


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    message: str | None = None
    """Why the engine rejected or aborted the choice."""


def merged_by_choice(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice, in the order choices first appear: when the server falls behind
    the engine (a loaded machine), one batch holds several outputs of a choice, and a stream
    chunk must name each choice once (clients read ``choices[0]`` as *the* delta)."""
    merged: dict[int, ChoiceDelta] = {}
    for delta in deltas:
        into = merged.get(delta.index)
        if into is None:
            merged[delta.index] = ChoiceDelta(
                delta.index,
                delta.text,
                list(delta.token_ids),
                None if delta.logprobs is None else list(delta.logprobs),
                delta.finish_reason,
                delta.message,
            )
            continue
        into.text += delta.text
        into.token_ids += delta.token_ids
        if delta.logprobs is not None:
            into.logprobs = (into.logprobs or []) + delta.logprobs
        into.finish_reason = delta.finish_reason or into.finish_reason
        into.message = delta.message or into.message
    return list(merged.values())


@dataclass
class _Choice:
    index: int
    engine_id: str
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    arrival: float
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    queue_time: float | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer,
        metrics: EngineMetrics,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        timeout: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_param: str | None = None,
    ) -> None:
        self.client = client
        self.grammar_param = grammar_param
        """The request field `params.grammar` comes from (named when the core refuses it)."""
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: dict[str, Any] | None = None
        """P/D producer leg: the signed params the engine returned with the final output."""
        self.metrics = metrics
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.timeout = timeout
        self.arrival = time.monotonic()
        # Each prompt counts once however many choices (n) it has, as OpenAI and vLLM count it.
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        self._queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self._choices: dict[str, _Choice] = {}
        want_logprobs = params.logprobs is not None
        unique = next(_engine_ids)  # clients may reuse an X-Request-Id; engine ids must not collide
        for i in range(len(prompts) * params.n):
            engine_id = f"{request_id}-{unique}-{i}"
            prompt = prompts[i // params.n]
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, params.stop)
            self._choices[engine_id] = _Choice(i, engine_id, detokenizer, want_logprobs, self.arrival)

    def _child_params(self, choice_index: int) -> SamplingParams:
        import dataclasses

        j = choice_index % self.params.n
        seed = self.params.seed
        if seed is not None and j:
            seed = (seed + j) % 2**63
        return dataclasses.replace(self.params, n=1, seed=seed)

    async def deltas(self) -> AsyncGenerator[list[ChoiceDelta], None]:
        """Yield each step's deltas until every choice finished; abort the rest on exit."""
        deadline = None if self.timeout is None else self.arrival + self.timeout
        try:
            for engine_id, choice in self._choices.items():
                prompt = self.prompts[choice.index // self.params.n]
                self.client.add(
                    engine_id,
                    prompt,
                    self._child_params(choice.index),
                    self._queue,
                    time.monotonic(),
                    kv_transfer_params=self.kv_transfer_params,
                )
            remaining = len(self._choices)
            while remaining:
                batch = [await self._next(deadline)]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                if deadline is not None and time.monotonic() > deadline:
                    # Read past the deadline (a server behind its engine finds a whole answer
                    # queued at once): too late to deliver, whatever the engine finished.
                    raise DeadlineExceeded
                deltas: list[ChoiceDelta] = []
                for item in batch:
                    if isinstance(item, EngineDeadError):
                        raise item
                    delta = self._apply(item)
                    if delta is not None:
                        deltas.append(delta)
                        if delta.finish_reason is not None:
                            remaining -= 1
                if deltas:
                    yield merged_by_choice(deltas)
        finally:
            unfinished = [c for c in self._choices.values() if c.finish_reason is None]
            if unfinished:
                # undelivered: a final output may already be in our queue, unread (the client
                # forgot the request), its blocks leased by a P/D producer core
                self.client.abort(
                    [c.engine_id for c in unfinished], "client gone or request cancelled", undelivered=True
                )
                now = time.monotonic()
                for choice in unfinished:
                    choice.finish_reason = "abort"
                    self._observe(choice, now)

    def release_transfer(self) -> None:
        """The response carrying `kv_transfer_params_out` will not reach the client (it went
        away): let the core release the producer's lease now instead of at its expiry."""
        if self.kv_transfer_params_out is not None:
            self.client.release_transfer([c.engine_id for c in self._choices.values()])

    async def _next(self, deadline: float | None) -> RequestOutput | EngineDeadError:
        if deadline is None:
            return await self._queue.get()
        left = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(self._queue.get(), max(left, 0.0))
        except TimeoutError as exc:
            raise DeadlineExceeded from exc

    def _apply(self, out: RequestOutput) -> ChoiceDelta | None:
        choice = self._choices.get(out.request_id)
        if choice is None or choice.finish_reason is not None:
            return None
        now = time.monotonic()
        if out.queue_time is not None:
            choice.queue_time = out.queue_time
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            self.kv_transfer_params_out = out.kv_transfer_params
        delta = choice.detokenizer.add(out.new_token_ids)
        text = delta.text
        # A speculative step may run past a stop string: nothing after it reaches the client.
        new_ids = out.new_token_ids[: delta.num_ids_kept]
        if new_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
            elif choice.last_token_at is not None:
                choice.gaps.extend([(now - choice.last_token_at) / len(new_ids)] * len(new_ids))
            choice.last_token_at = now
        choice.num_generated += len(new_ids)
        self.usage.completion_tokens += len(new_ids)
        finish: str | None = None
        if delta.stopped:
            finish = "stop"
            self.client.abort([choice.engine_id], "stop string matched")
        elif out.finished:
            text += choice.detokenizer.finish().text
            finish = out.finish_reason
        if finish is not None:
            choice.finish_reason = finish
            self.usage.cached_tokens += choice.num_cached_tokens
            self._observe(choice, now)
        logprobs = out.new_logprobs if choice.want_logprobs else None
        if logprobs:
            logprobs = logprobs[: len(new_ids)]
        if not text and not new_ids and finish is None:
            return None
        message = out.finish_message if out.finished else None
        return ChoiceDelta(choice.index, text, list(new_ids), logprobs, finish, message)

    def _observe(self, choice: _Choice, now: float) -> None:
        self.metrics.observe_finished(
            choice.finish_reason or "abort",
            ttft=None if choice.first_token_at is None else choice.first_token_at - choice.arrival,
            e2e=now - choice.arrival,
            queue_time=choice.queue_time,
            inter_token=choice.gaps,
        )
