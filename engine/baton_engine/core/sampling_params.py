"""Per-request sampling settings, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Most top-n logprobs a request may ask for per token."""

MAX_N = 16
"""Most parallel completions (`n`) one request may ask for."""

MAX_INT32 = 2**31 - 1
"""Largest `top_k`, `max_tokens` and token id: the persistent batch keeps them in int32 columns."""

MAX_TEMPERATURE = 1e4
"""Largest temperature: far past the point where sampling is uniform, and finite in float32
(the batch's column) so that ``logits / temperature`` never divides by zero or infinity."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    Invalid values raise `ValueError` naming the field. ``stop`` strings are not checked by the
    scheduler (which sees tokens only): the detokenizer matches them on text and aborts the request.
    """

    temperature: float = 1.0
    """0 means greedy; finite, at most `MAX_TEMPERATURE`."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables it; at most `MAX_INT32` (k >= vocab keeps all)."""
    max_tokens: int = 16
    """Most generated tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on detokenized text (not by the scheduler)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (kept in the output), even with `ignore_eos`."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    seed: int | None = None
    """Per-request seed; None uses the engine's generator."""
    logprobs: int | None = None
    """Return the top-n logprobs of each generated token (0..20; 0 = only the sampled one)."""
    n: int = 1
    """Parallel completions of one prompt."""
    grammar: str | None = None
    """Structured output: the grammar every completion must follow, in llguidance's serialized
    form (`baton_engine.structured.grammar` builds it from a JSON schema, a ``response_format``
    or tool choices). Sampling only picks tokens it allows, and the request stops (``stop``)
    once it is complete. None: free text."""

    def __post_init__(self) -> None:
        # JSON gives lists; keep tuples so the frozen object really is immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list | tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list | tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or not 0.0 <= self.temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(
                f"top_k must be an integer in [-1, {MAX_INT32}] (-1 or 0 disables it), got {self.top_k!r}"
            )
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of integers in [0, {MAX_INT32}], got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or null, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(
                "grammar must be a non-empty string (an llguidance grammar) or null, got "
                f"{self.grammar!r:.40}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
