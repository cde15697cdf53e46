"""The engine core's structured-output state: one `GrammarMatcher` per constrained request, and
the per-step bitmask (torch-free; the one owner of request -> grammar state).

How the core drives it (each call is one hook; the scheduler and the runner stay grammar-blind
apart from carrying the bitmask):

- ``add(request_id, grammar, replay=...)`` when a request with ``SamplingParams.grammar`` arrives
  (a P/D decode leg replays the prefill leg's first token, so its grammar state continues there);
  a grammar that cannot be built rejects the request with the reason.
- ``step_bitmask(rows)`` after ``schedule()``: the bitmask of the step's sampled positions (one
  row per position; a verify row of k drafts takes k + 1) and their indices in the logits, for the
  runner to apply on the device before sampling. Drafts past what the grammar allows are cut first
  (``cut_drafts``), so a draft the grammar refuses is never verified.
- ``accept(request_id, tokens)`` after ``postprocess()`` with the tokens the request kept; returns
  True once the grammar is complete (the core then finishes the request with ``stop``).
- ``rollback(request_id, n)`` when a preempted request will recompute tokens it had accepted;
  ``remove(request_id)`` when the request finishes or is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton_engine.structured.grammar import StructuredOutputError
from baton_engine.structured.matcher import Bitmask, GrammarMatcher, bitmask_words, grammar_tokenizer


@dataclass(frozen=True)
class SampledRow:
    """One constrained request's part of a step: where its sampled positions start in the
    logits, and its draft tokens (empty for a plain decode or a prefill's last chunk)."""

    request_id: str
    logits_row: int
    drafts: tuple[int, ...] = ()


@dataclass
class StepBitmask:
    bitmask: Bitmask
    """[len(logits_rows), words]: the masks of the constrained positions, in order."""
    logits_rows: list[int]
    """The logits row each bitmask row applies to."""


class StructuredOutputManager:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = grammar_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._matchers: dict[str, GrammarMatcher] = {}
        self._eos = frozenset(eos_token_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: str, replay: list[int] | None = None) -> None:
        """Track `request_id`; raises `StructuredOutputError` (the request is to be rejected)."""
        if request_id in self._matchers:
            raise ValueError(f"request {request_id!r} already has a grammar")
        matcher = GrammarMatcher(self._tokenizer, grammar)
        if replay:
            taken = matcher.accept(replay)
            if taken != len(replay):
                raise StructuredOutputError(
                    "kv_transfer_params",
                    f"the prefill leg's token {replay[taken]} is not allowed by the grammar",
                )
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def cut_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The leading drafts the grammar can take (the rest are never verified)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not drafts:
            return drafts
        return drafts[: matcher.valid_prefix(drafts)]

    def step_bitmask(self, rows: list[SampledRow]) -> StepBitmask | None:
        """Masks for the constrained rows of a step; None when no row is constrained."""
        constrained = [row for row in rows if row.request_id in self._matchers]
        if not constrained:
            return None
        count = sum(1 + len(row.drafts) for row in constrained)
        bitmask = np.empty((count, self._words), dtype=np.int32)
        logits_rows: list[int] = []
        at = 0
        for row in constrained:
            matcher = self._matchers[row.request_id]
            matcher.fill_draft_bitmasks(list(row.drafts), bitmask, at)
            logits_rows.extend(range(row.logits_row, row.logits_row + 1 + len(row.drafts)))
            at += 1 + len(row.drafts)
        return StepBitmask(bitmask, logits_rows)

    def accept(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by the tokens the request kept (a final EOS ends a complete grammar); True once
        the grammar allows nothing more. Raises if a token breaks the grammar: the mask makes that
        impossible, so it is a bug, not bad input."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        taken = matcher.accept(tokens)
        rest = tokens[taken:]
        if rest and not (rest == rest[:1] and rest[0] in self._eos and matcher.accepting):
            raise RuntimeError(
                f"request {request_id}: token {rest[0]} broke its grammar ({matcher.error or 'refused'})"
            )
        return matcher.finished or bool(rest)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None:
            matcher.rollback(num_tokens)
