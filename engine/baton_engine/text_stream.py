"""One completion's text as tokens arrive: incremental detokenization plus stop strings.

Shared by the offline `LLM` and the HTTP server, so both cut at stop strings identically.
"""

from __future__ import annotations

from typing import Protocol

from baton_engine.stop_strings import StopStringMatcher


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class _IncrementalDecoder:
    """Decodes a growing id list into text deltas that never end inside a UTF-8 character.

    Decodes a short window (from a few tokens before the last emitted point) so that the cost
    per token stays constant and tokenizers that merge spaces across tokens decode correctly.
    """

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = decode(self.ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return delta


class TextStream:
    def __init__(self, tokenizer: TokenDecoder, stops: tuple[str, ...] | list[str] = ()) -> None:
        self._decoder = _IncrementalDecoder(tokenizer)
        self._stops = StopStringMatcher(stops)
        self.text = ""
        """Everything emitted so far."""
        self.num_ids_kept = 0
        """How many ids of the latest `push` are part of the output (see `push`)."""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller aborts the request in the core."""
        return self._stops.matched is not None

    def push(self, new_ids: list[int]) -> str:
        """Feed tokens; returns the text that can be shown now. Afterwards `num_ids_kept` says
        how many of `new_ids` belong to the output: with a stop string, the tokens up to the one
        that completed it — a speculative step can deliver tokens past a stop string, and those
        must not reach the client (one token at a time, they would never have been generated)."""
        if len(new_ids) > 1 and self._stops.stops:
            delta = ""
            for i, token_id in enumerate(new_ids):
                delta += self._stops.push(self._decoder.push([token_id]))
                if self.stopped:
                    self.num_ids_kept = i + 1
                    break
            else:
                self.num_ids_kept = len(new_ids)
        else:
            delta = self._stops.push(self._decoder.push(new_ids))
            self.num_ids_kept = len(new_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Call once when the request finished without a stop string match."""
        delta = self._stops.push(self._decoder.flush()) if not self.stopped else ""
        delta += self._stops.flush()
        self.text += delta
        return delta
