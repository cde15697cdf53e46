"""One request's grammar state, followed token by token (torch-free: llguidance + numpy).

The scheduler's `StructuredOutputManager` keeps a `GrammarMatcher` per constrained request.
When a step is planned it writes the request's allowed-token bitmask into the step's int32
array (`fill_bitmask`, or `fill_draft_bitmasks` for a verify row: one mask per position); the
runner applies it to the logits (`baton_engine.worker.token_bitmask`); after the step the kept
tokens are accepted (`accept`). Speculative drafts are cut to the prefix the grammar allows
(`valid_prefix`) before they are verified.
"""

from __future__ import annotations

from functools import lru_cache

import llguidance
import numpy as np
import numpy.typing as npt

from baton_engine.structured.grammar import StructuredOutputError

Bitmask = npt.NDArray[np.int32]
"""[rows, ceil(vocab / 32)]: bit t % 32 of word t // 32 set = token t allowed."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@lru_cache(maxsize=4)
def grammar_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (its token trie; ~1 s to build, so built once). The
    vocabulary is the model's (logits width), which may exceed the tokenizer's."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarMatcher:
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.vocab_size = tokenizer.vocab_size
        if self._matcher.is_error():
            raise StructuredOutputError("grammar", self._matcher.get_error())

    def copy(self) -> GrammarMatcher:
        """An independent matcher in this one's state; the compiled grammar is shared, so a copy
        costs microseconds where compiling a large schema takes a large fraction of a second."""
        twin = object.__new__(GrammarMatcher)
        twin._matcher = self._matcher.deep_copy()
        twin.vocab_size = self.vocab_size
        return twin

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    def fill_bitmask(self, bitmask: Bitmask, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (drops the GIL while it works)."""
        target = bitmask[row]
        if not target.flags.c_contiguous or target.dtype != np.int32:
            raise ValueError("bitmask rows must be C-contiguous int32")
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def accept(self, tokens: list[int]) -> int:
        """Consume sampled tokens; returns how many the grammar took (all, unless the model
        sampled outside the mask, which the mask prevents)."""
        return int(self._matcher.try_consume_tokens(tokens))

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar can consume from the current state: drafts past
        it are dropped before verification. An upper bound: the verify masks
        (`fill_draft_bitmasks`) decide, and may refuse a token the grammar could consume but
        that a longer token must spell (``"`` before ``,`` where ``",`` is one token)."""
        return int(self._matcher.validate_tokens(drafts))

    def fill_draft_bitmasks(self, drafts: list[int], bitmask: Bitmask, first_row: int) -> None:
        """Masks for a verify row: position 0 from the current state, position k after the first
        k drafts (which must be a `valid_prefix`); the state is left unchanged."""
        self.fill_bitmask(bitmask, first_row)
        for k, token in enumerate(drafts, start=1):
            if not self._matcher.consume_token(token):
                raise ValueError(f"draft token {token} at position {k - 1} is not allowed by the grammar")
            self.fill_bitmask(bitmask, first_row + k)
        if drafts:
            self._matcher.rollback(len(drafts))


def allowed(bitmask: Bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
