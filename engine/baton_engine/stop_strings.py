"""Stop strings matched on streamed text, holding back just enough to never emit part of one.

Text arrives in deltas (from the incremental detokenizer). A stop string may straddle deltas,
so up to ``len(longest stop) - 1`` trailing characters are held back until the next delta or
the end of the request. On a match the output is cut *before* the stop string (as OpenAI does)
and the caller aborts the request in the engine core.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""

    def push(self, delta: str) -> str:
        """Feed new text; return what can be emitted now ("" after a match)."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return delta
        searched_from = max(0, len(self._pending) - self._hold)
        self._pending += delta
        best: int | None = None
        for stop in self.stops:
            at = self._pending.find(stop, searched_from)
            if at != -1 and (best is None or at < best):
                best, self.matched = at, stop
        if best is not None:
            emit, self._pending = self._pending[:best], ""
            return emit
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return emit

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not hit a stop string."""
        emit, self._pending = self._pending, ""
        return "" if self.matched is not None else emit
