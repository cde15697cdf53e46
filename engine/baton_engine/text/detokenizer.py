"""Incremental detokenization for streaming, with stop strings matched on the text.

Two things are held back from the stream until they are settled:

* bytes of a character not yet complete (a multi-byte UTF-8 character split across tokens
  decodes to U+FFFD until its last byte arrives), and
* a tail of the text that could be the beginning of a stop string.

When a stop string appears, the output is cut right before it (OpenAI semantics) and the
delta says the request must stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from baton_engine.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
#: Prompt tokens kept as decoding context, so the first output token decodes as it would in place.
_CONTEXT_TOKENS = 4


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str
    """New output text, safe to send."""
    stop_string: str | None = None
    """The stop string that matched; the request must be aborted (already truncated)."""
    num_ids_kept: int = field(default=0, compare=False)
    """How many of the tokens given to `add` belong to the output: all of them, or with a stop
    string those up to the one that completed it. A speculative step can deliver tokens past a
    stop string; one token at a time they would never have been generated, so callers drop them
    (from token ids, logprobs and usage)."""

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        # _ids[_prefix:_read] is the context already turned into text; _ids[_read:] is pending.
        self._prefix = 0
        self._read = len(self._ids)
        self._stops = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # all settled text, emitted or held back for stop matching
        self._emitted = 0
        self._stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """Text emitted so far (the final output once finished)."""
        return self._text[: self._emitted]

    @property
    def stopped(self) -> bool:
        return self._stop_string is not None

    def add(self, token_ids: Iterable[int]) -> DetokenizerDelta:
        """Feed newly sampled tokens; returns what may be streamed now."""
        if self.stopped:
            return DetokenizerDelta("", self._stop_string)
        tokens = [int(token) for token in token_ids]
        if len(tokens) > 1 and self._stops:
            # Token by token, exactly as they would have arrived without speculation.
            text = ""
            for i, token in enumerate(tokens):
                delta = self._add_tokens([token])
                text += delta.text
                if delta.stopped:
                    return DetokenizerDelta(text, delta.stop_string, i + 1)
            return DetokenizerDelta(text, None, len(tokens))
        return self._add_tokens(tokens)

    def _add_tokens(self, tokens: list[int]) -> DetokenizerDelta:
        self._ids.extend(tokens)
        self._text += self._settled_text()
        delta = self._release(final=False)
        return DetokenizerDelta(delta.text, delta.stop_string, len(tokens))

    def finish(self) -> DetokenizerDelta:
        """The request ended for another reason (length, EOS): release everything held back."""
        if self.stopped:
            return DetokenizerDelta("", self._stop_string)
        self._text += self._decode_new(allow_incomplete=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, allow_incomplete: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not allow_incomplete):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return after[len(before) :]

    def _settled_text(self) -> str:
        return self._decode_new(allow_incomplete=False)

    def _release(self, final: bool) -> DetokenizerDelta:
        # A match cannot start before _emitted: a possible stop prefix is never emitted.
        match_at, matched = -1, None
        for stop in self._stops:
            at = self._text.find(stop, self._emitted)
            if at >= 0 and (match_at < 0 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            delta = self._text[self._emitted : match_at]
            self._text = self._text[:match_at]
            self._emitted = match_at
            self._stop_string = matched
            return DetokenizerDelta(delta, matched)
        end = len(self._text) if final else len(self._text) - self._stop_prefix_length()
        delta = self._text[self._emitted : end]
        self._emitted = end
        return DetokenizerDelta(delta)

    def _stop_prefix_length(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of a stop string."""
        pending = len(self._text) - self._emitted
        for length in range(min(self._longest_stop - 1, pending), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
