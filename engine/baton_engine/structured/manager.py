"""The scheduler's structured-output state: one `GrammarMatcher` per constrained request and the
bitmasks of each step (torch-free; the one owner of request -> grammar state).

The scheduler calls these hooks (nothing else touches a matcher):

- `add` when a request with ``SamplingParams.grammar`` is queued: True if its grammar was
  compiled before (the request can run now); otherwise the grammar compiles on the manager's
  worker thread (a large schema takes a large fraction of a second, which would stall every
  running stream if it ran on the step loop) and the request waits.
- `take_compiled` at the start of each step: the waiting requests whose grammar is now compiled
  (they may run), and those whose grammar failed to compile, with the reason (the scheduler
  rejects them). `wait_compiling` blocks briefly on the compiles when nothing else can run.
- `cut_drafts` while a step is planned: a decode row's drafts are cut to the prefix the grammar
  can take, so a draft the grammar refuses is never verified.
- `step_bitmask` once the step is planned: the bitmasks of its constrained sampled positions
  (one per position; a verify row of K drafts takes K + 1) and their logits rows, which the
  runner applies on the device before sampling (`SchedulerOutput.grammar_bitmask`).
- `accept` in ``postprocess`` with each token a request kept (and on a P/D decode leg with the
  prefill leg's first token, so its grammar continues from there); True once the grammar
  allows nothing more (the scheduler then finishes the request with ``stop``).
- `remove` when the request finishes, whatever the reason (stop, length, abort, rejection), or
  is aborted while its grammar compiles (the compile still ends, and its result is kept to copy
  from).

A preempted request keeps its tokens and recomputes their KV only, so its grammar state stays
as it is; a failed forward (``discard_step``) accepted nothing, so there is nothing to undo.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from baton_engine.structured.grammar import StructuredOutputError
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


@dataclass(frozen=True)
class CompiledGrammars:
    """What `StructuredOutputManager.take_compiled` found: requests whose grammar compiled."""

    ready: list[int]
    """Requests that may run now (in the order they were added)."""
    failed: list[tuple[int, str]]
    """Requests whose grammar cannot be followed, each with the reason (``"grammar: ..."``)."""


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        compile_executor: Executor | None = None,
    ) -> None:
        """`tokenizer_json`: the model's tokenizer as HF ``tokenizer.json`` text, asked for on
        the first grammar (llguidance's token trie takes about a second to build, a cost only
        engines that serve structured output pay; it is built on the compile thread).
        `vocab_size` is the logits' width. `compile_executor`: where grammars compile (default:
        one worker thread of the manager's own, started on the first grammar; llguidance
        releases the GIL while it compiles)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._words = bitmask_words(vocab_size)
        self._executor = compile_executor
        self._owns_executor = compile_executor is None
        self._tokenizer: llguidance.LLTokenizer | None = None
        """llguidance's view of the tokenizer (built and read on the compile thread only)."""
        self._matchers: dict[int, GrammarMatcher] = {}
        self._compiled: OrderedDict[str, GrammarMatcher] = OrderedDict()
        """Grammar text -> a matcher that never advanced, least recently used first."""
        self._compiling: dict[str, Future[GrammarMatcher]] = {}
        """Grammar text -> its compile on the worker (one per text, however many wait for it)."""
        self._waiting: dict[int, str] = {}
        """Request -> the grammar text it waits for (in the order requests were added)."""

    def __contains__(self, req_id: int) -> bool:
        """`req_id` is followed (its grammar is compiled; it may run)."""
        return req_id in self._matchers

    def __len__(self) -> int:
        """Requests with grammar state: followed, or waiting for their grammar to compile."""
        return len(self._matchers) + len(self._waiting)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile."""
        return len(self._waiting)

    @property
    def num_compiles(self) -> int:
        """Grammars compiling (or compiled, not yet taken by `take_compiled`), waited for or not."""
        return len(self._compiling)

    def add(self, req_id: int, grammar: str) -> bool:
        """Follow `req_id`'s output with `grammar`: True if it can run now, False if it waits
        for the grammar to compile (`take_compiled` says when, or why it cannot)."""
        if req_id in self._matchers or req_id in self._waiting:
            raise ValueError(f"request {req_id} already has a grammar")
        fresh = self._compiled.get(grammar)
        if fresh is not None:
            self._compiled.move_to_end(grammar)
            self._matchers[req_id] = fresh.copy()
            return True
        future = self._compiling.get(grammar)
        if future is None:
            future = self._compiling[grammar] = self._compile_executor().submit(self._compile, grammar)
        if future.done() and future.exception() is None:  # (an executor that runs on the caller)
            self._matchers[req_id] = future.result().copy()
            return True
        self._waiting[req_id] = grammar
        return False

    def take_compiled(self) -> CompiledGrammars:
        """The waiting requests whose grammar finished compiling since the last call."""
        done = {grammar: future for grammar, future in self._compiling.items() if future.done()}
        if not done:
            return CompiledGrammars([], [])
        errors: dict[str, str] = {}
        for grammar, future in done.items():
            del self._compiling[grammar]
            exc = future.exception()
            if exc is None:
                self._remember(grammar, future.result())
            else:
                errors[grammar] = str(exc) if isinstance(exc, StructuredOutputError) else f"grammar: {exc}"
        ready: list[int] = []
        failed: list[tuple[int, str]] = []
        for req_id, grammar in list(self._waiting.items()):
            if grammar not in done:
                continue
            del self._waiting[req_id]
            if grammar in errors:
                failed.append((req_id, errors[grammar]))
            else:
                self._matchers[req_id] = done[grammar].result().copy()
                ready.append(req_id)
        return CompiledGrammars(ready, failed)

    def wait_compiling(self, timeout: float) -> None:
        """Block until a compile ends or `timeout` seconds pass (for a loop with nothing else
        to do: it would otherwise spin against the compile thread for the CPU)."""
        if self._compiling:
            concurrent.futures.wait(
                list(self._compiling.values()), timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def close(self) -> None:
        """Stop the compile thread (a compile under way ends first); queued compiles are dropped."""
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _compile_executor(self) -> Executor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        return self._executor

    def _compile(self, grammar: str) -> GrammarMatcher:
        """On the compile thread: raises `StructuredOutputError` for a grammar llguidance refuses."""
        if self._tokenizer is None:
            self._tokenizer = grammar_tokenizer(self._tokenizer_json(), self.vocab_size, self.eos_token_ids)
        return GrammarMatcher(self._tokenizer, grammar)

    def _remember(self, grammar: str, fresh: GrammarMatcher) -> None:
        self._compiled[grammar] = fresh
        if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
            self._compiled.popitem(last=False)

    @property
    def num_compiled(self) -> int:
        """Compiled grammars kept to copy from (at most `COMPILED_GRAMMARS_KEPT`)."""
        return len(self._compiled)

    def remove(self, req_id: int) -> None:
        self._matchers.pop(req_id, None)
        self._waiting.pop(req_id, None)

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
