"""The scheduler's structured-output state: one `GrammarMatcher` per constrained request and the
bitmasks of each step (torch-free; the one owner of request -> grammar state).

The scheduler calls these hooks (nothing else touches a matcher):

- `add` when a request with ``SamplingParams.grammar`` is queued; a grammar that cannot be built
  raises `StructuredOutputError` (the scheduler rejects the request with the reason).
- `cut_drafts` while a step is planned: a decode row's drafts are cut to the prefix the grammar
  can take, so a draft the grammar refuses is never verified.
- `step_bitmask` once the step is planned: the bitmasks of its constrained sampled positions
  (one per position; a verify row of K drafts takes K + 1) and their logits rows, which the
  runner applies on the device before sampling (`SchedulerOutput.grammar_bitmask`).
- `accept` in ``postprocess`` with each token a request kept (and on a P/D decode leg with the
  prefill leg's first token, so its grammar continues from there); True once the grammar
  allows nothing more (the scheduler then finishes the request with ``stop``).
- `remove` when the request finishes, whatever the reason (stop, length, abort, rejection).

A preempted request keeps its tokens and recomputes their KV only, so its grammar state stays
as it is; a failed forward (``discard_step``) accepted nothing, so there is nothing to undo.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np

from baton_engine.structured.matcher import Bitmask, GrammarMatcher, bitmask_words, grammar_tokenizer

COMPILED_GRAMMARS_KEPT = 8
"""How many compiled grammars (fresh matchers) `StructuredOutputManager` keeps to copy from: the
n samples of one request and clients that send one schema over and over compile it once. A
grammar at llguidance's size limit compiles in ~0.3 s on the step loop and holds ~17 MiB; its
copies share that compiled form."""


class GrammarRefusedToken(ValueError):
    """A token the grammar does not allow at that point."""


@dataclass(frozen=True)
class SampledRow:
    """One constrained request's part of a step: where its sampled positions start among the
    step's logits rows, and the drafts it verifies (empty for a plain decode or a prompt's
    last chunk)."""

    req_id: int
    logits_row: int
    drafts: tuple[int, ...] = ()


@dataclass
class StepBitmask:
    bitmask: Bitmask
    """``[len(logits_rows), words]``: the masks of the constrained positions, in order."""
    logits_rows: list[int]
    """The logits row each bitmask row applies to (ascending)."""


class StructuredOutputManager:
    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        """`tokenizer_json`: the model's tokenizer as HF ``tokenizer.json`` text, asked for on
        the first grammar (llguidance's token trie takes about a second to build, a cost only
        engines that serve structured output pay). `vocab_size` is the logits' width."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._words = bitmask_words(vocab_size)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[int, GrammarMatcher] = {}
        self._compiled: OrderedDict[str, GrammarMatcher] = OrderedDict()
        """Grammar text -> a matcher that never advanced, least recently used first."""

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, req_id: int, grammar: str) -> None:
        """Follow `req_id`'s output with `grammar`; raises `StructuredOutputError`."""
        if req_id in self._matchers:
            raise ValueError(f"request {req_id} already has a grammar")
        if self._tokenizer is None:
            self._tokenizer = grammar_tokenizer(self._tokenizer_json(), self.vocab_size, self.eos_token_ids)
        fresh = self._compiled.get(grammar)
        if fresh is None:
            fresh = GrammarMatcher(self._tokenizer, grammar)  # raises before anything is kept
            self._compiled[grammar] = fresh
            if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        self._matchers[req_id] = fresh.copy()

    @property
    def num_compiled(self) -> int:
        """Compiled grammars kept to copy from (at most `COMPILED_GRAMMARS_KEPT`)."""
        return len(self._compiled)

    def remove(self, req_id: int) -> None:
        self._matchers.pop(req_id, None)

    def cut_drafts(self, req_id: int, drafts: list[int]) -> list[int]:
        """The leading `drafts` the grammar can take from the request's current state."""
        matcher = self._matchers.get(req_id)
        if matcher is None or not drafts:
            return drafts
        return drafts[: matcher.valid_prefix(drafts)]

    def step_bitmask(self, rows: list[SampledRow]) -> StepBitmask:
        """The masks of `rows` (all constrained: in this manager), in order."""
        count = sum(1 + len(row.drafts) for row in rows)
        bitmask = np.empty((count, self._words), dtype=np.int32)
        logits_rows: list[int] = []
        at = 0
        for row in rows:
            self._matchers[row.req_id].fill_draft_bitmasks(list(row.drafts), bitmask, at)
            logits_rows.extend(range(row.logits_row, row.logits_row + 1 + len(row.drafts)))
            at += 1 + len(row.drafts)
        return StepBitmask(bitmask, logits_rows)

    def accept(self, req_id: int, tokens: list[int]) -> bool:
        """Advance by the tokens the request kept; True once the grammar is complete (it allows
        nothing but EOS: a final EOS is taken as that end). Raises `GrammarRefusedToken` for a
        token the grammar does not allow (the state then holds the tokens before it)."""
        matcher = self._matchers[req_id]
        taken = matcher.accept(tokens)
        rest = tokens[taken:]
        if rest and not (len(rest) == 1 and rest[0] in self.eos_token_ids and matcher.accepting):
            reason = matcher.error or "not allowed here"
            raise GrammarRefusedToken(f"token {rest[0]} is refused by the request's grammar ({reason})")
        return matcher.finished or bool(rest)
