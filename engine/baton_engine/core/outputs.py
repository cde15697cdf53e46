"""What the engine core reports per request after each step.

Plain data with a compact list form (`to_wire` / `from_wire`) so the core process can send a
step's outputs to the server process as one msgpack message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TokenLogprobs = list[tuple[int, float]]
"""One generated token's logprobs: the sampled ``(token id, logprob)`` first, then the top-n."""


@dataclass
class RequestOutput:
    """One request's progress since its previous output (the engine core returns one per request
    that gained tokens or finished in a step)."""

    request_id: str
    """The caller's request id (`EngineCore.add_request`)."""
    new_token_ids: list[int]
    """Tokens generated since the previous output of this request."""
    finished: bool = False
    """The last output of this request: nothing follows."""
    finish_reason: str | None = None
    """``stop`` | ``length`` | ``abort`` | ``rejected`` when finished."""
    finish_message: str | None = None
    """Why a request was rejected or aborted, or which stop token matched."""
    new_logprobs: list[TokenLogprobs] | None = None
    """Per new token, when the request asked for logprobs."""
    num_prompt_tokens: int = 0
    """Tokens of the prompt (usage accounting)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    queue_time: float | None = None
    """Seconds between arrival and first scheduling (on the first output that knows it)."""
    kv_transfer_params: dict[str, Any] | None = None
    """P/D producer: the signed params a consumer pulls this request's KV with (final output)."""

    def to_wire(self) -> list[Any]:
        return [
            self.request_id,
            self.new_token_ids,
            self.finished,
            self.finish_reason,
            self.finish_message,
            None if self.new_logprobs is None else [[list(p) for p in tok] for tok in self.new_logprobs],
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.queue_time,
            self.kv_transfer_params,
        ]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> RequestOutput:
        logprobs = raw[5]
        return cls(
            request_id=raw[0],
            new_token_ids=list(raw[1]),
            finished=raw[2],
            finish_reason=raw[3],
            finish_message=raw[4],
            new_logprobs=None
            if logprobs is None
            else [[(int(t), float(p)) for t, p in tok] for tok in logprobs],
            num_prompt_tokens=raw[6],
            num_cached_tokens=raw[7],
            queue_time=raw[8],
            kv_transfer_params=raw[9] if len(raw) > 9 else None,
        )
