"""A sequence's token ids mirrored in a growing numpy array, synced by appending what is new.

Token lists only ever grow (sampled tokens are appended; preemption keeps them), so the
proposer converts each token to numpy once instead of the whole list every step.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class TokenBuffer:
    def __init__(self, capacity: int = 256) -> None:
        self._data: npt.NDArray[np.int64] = np.empty(max(capacity, 16), dtype=np.int64)
        self._len = 0

    def sync(self, token_ids: list[int]) -> npt.NDArray[np.int64]:
        """Append ``token_ids[len(self):]`` and return a view of all tokens."""
        n = len(token_ids)
        if n < self._len:
            raise ValueError(f"token list shrank from {self._len} to {n} tokens")
        if n > len(self._data):
            grown = np.empty(max(n, 2 * len(self._data)), dtype=np.int64)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        if n > self._len:
            self._data[self._len : n] = token_ids[self._len : n]
            self._len = n
        return self._data[:n]

    def __len__(self) -> int:
        return self._len
