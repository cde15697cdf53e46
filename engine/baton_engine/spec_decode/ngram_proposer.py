"""Prompt-lookup drafts: continue the sequence the way it continued after the same n-gram earlier.

For a sequence ``t[0..L)`` the proposer looks for earlier occurrences of its suffix: an index
``e < L - 1`` with ``t[e - j] == t[L - 1 - j]`` for ``j < n``. The longest such match with
``ngram_min <= n <= ngram_max`` wins (longer context predicts better), the most recent among
equally long ones. The draft is what followed the match, ``t[e + 1 : e + 1 + K]``, copied the
way LZ77 copies: where that runs past the end of the sequence it continues with the draft itself
(period ``L - 1 - e``), so a repeating tail keeps repeating instead of yielding a short draft.

All candidates are scored together with numpy: one comparison finds every earlier occurrence
of the last token, then each further step back compares the surviving candidates only — at most
``ngram_max`` vectorised comparisons per sequence, no Python loop over positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if ngram_min < 1:
            raise ValueError(f"ngram_min must be >= 1, got {ngram_min}")
        if ngram_max < ngram_min:
            raise ValueError(f"ngram_max ({ngram_max}) must be >= ngram_min ({ngram_min})")
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(
        self, token_ids: Sequence[int] | npt.NDArray[np.int64], max_drafts: int | None = None
    ) -> list[int]:
        """Up to ``min(K, max_drafts)`` draft tokens to follow `token_ids`; [] when no n-gram of
        at least `ngram_min` tokens recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0 or length <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidate match ends: earlier occurrences of the last token that have a successor.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        if not len(ends):
            return []
        match_len = np.ones(len(ends), dtype=np.int64)
        alive = ends
        alive_idx = np.arange(len(ends))
        for j in range(1, min(self.ngram_max, length - 1)):
            keep = alive >= j
            alive, alive_idx = alive[keep], alive_idx[keep]
            keep = tokens[alive - j] == tokens[length - 1 - j]
            alive, alive_idx = alive[keep], alive_idx[keep]
            if not len(alive):
                break
            match_len[alive_idx] += 1
        best = int(match_len.max())
        if best < self.ngram_min:
            return []
        end = int(ends[match_len == best][-1])
        period = length - 1 - end
        drafts: list[int] = tokens[end + 1 + np.arange(k) % period].tolist()
        return drafts
