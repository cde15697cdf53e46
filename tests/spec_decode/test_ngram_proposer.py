"""The n-gram proposer: exact drafts for constructed sequences, and agreement with a brute-force
reference on random sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from baton_engine.spec_decode.ngram_proposer import NgramProposer
from baton_engine.spec_decode.token_buffer import TokenBuffer


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Longest suffix n-gram (n_min..n_max) found earlier, most recent occurrence; LZ77 copy."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[end + 1 + i])
                return extended[length:]
    return []


@pytest.mark.parametrize(
    ("tokens", "k", "n_min", "n_max", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, 1, 4, [4, 1, 2]),  # 3-gram [1, 2, 3] seen at the start
        ([1, 2, 9, 1, 2, 7, 1, 2], 3, 1, 4, [7, 1, 2]),  # most recent of two equal matches
        ([1, 2, 9, 5, 2, 7, 1, 2], 2, 1, 4, [9, 5]),  # the longer match wins over a recent 1-gram
        ([5, 5, 5, 5, 5], 3, 1, 4, [5, 5, 5]),  # overlapping match: the run continues
        ([1, 2, 1, 2, 1], 5, 1, 4, [2, 1, 2, 1, 2]),  # period 2 copied past the end
        ([1, 9, 2, 1], 3, 2, 4, []),  # only a 1-gram recurs, 2 needed
        ([1, 2, 3], 3, 1, 4, []),  # nothing recurs
        ([7], 3, 1, 4, []),
        ([3, 3], 2, 1, 4, [3, 3]),
        ([1, 2, 3, 4, 8, 2, 3, 4, 9, 1, 2, 3, 4], 2, 1, 3, [9, 1]),  # n capped at 3: recent wins
        ([1, 2, 3, 4, 8, 2, 3, 4, 9, 1, 2, 3, 4], 2, 1, 4, [8, 2]),  # n=4 tells them apart
    ],
)
def test_drafts(tokens: list[int], k: int, n_min: int, n_max: int, expected: list[int]) -> None:
    assert NgramProposer(k, n_min, n_max).propose(tokens) == expected
    assert brute_force(tokens, k, n_min, n_max) == expected


def test_max_drafts_caps_the_draft() -> None:
    proposer = NgramProposer(4, 1, 4)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(tokens) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_drafts=2) == [3, 4]
    assert proposer.propose(tokens, max_drafts=0) == []
    assert proposer.propose(tokens, max_drafts=-3) == []
    assert proposer.propose(np.asarray(tokens, dtype=np.int64), max_drafts=9) == [3, 4, 5, 6]


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_brute_force_on_random_sequences(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 4)
        assert NgramProposer(k, n_min, n_max).propose(tokens) == brute_force(tokens, k, n_min, n_max), (
            tokens,
            k,
            n_min,
            n_max,
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 4), "num_speculative_tokens must be >= 1, got 0"),
        ((2, 0, 4), "ngram_min must be >= 1, got 0"),
        ((2, 3, 2), r"ngram_max \(2\) must be >= ngram_min \(3\)"),
    ],
)
def test_bad_settings(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def test_token_buffer_appends_only_new_tokens() -> None:
    buffer = TokenBuffer(capacity=1)
    tokens = [1, 2, 3]
    assert buffer.sync(tokens).tolist() == [1, 2, 3]
    tokens += list(range(100))
    assert buffer.sync(tokens).tolist() == [1, 2, 3, *range(100)]
    assert len(buffer) == 103
    with pytest.raises(ValueError, match="token list shrank from 103 to 2 tokens"):
        buffer.sync([1, 2])
