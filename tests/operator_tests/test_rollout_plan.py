"""The decode-first rollout sequence: exact sequences, the invariants of every (P, D, capacity)
combination, and how `advance` picks the state to apply from what the cluster shows."""

from __future__ import annotations

import itertools
import math

import pytest

from baton_operator.rollout.plan import Counts, Observed, Step, advance, steps


def flat(sequence: list[Step]) -> list[tuple[int, int, int, int]]:
    """(new prefill, new decode, old prefill, old decode) per state."""
    return [(s.new.prefill, s.new.decode, s.old.prefill, s.old.decode) for s in sequence]


@pytest.mark.parametrize(
    ("prefill", "decode", "surge", "expected"),
    [
        (1, 1, True, [(0, 1, 1, 1), (1, 1, 1, 1), (1, 1, 0, 1), (1, 1, 0, 0)]),
        # P < D: the single prefill pod stays in the old generation while it has decode pods
        (1, 2, True, [(0, 1, 1, 2), (1, 1, 1, 2), (1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 0, 1), (1, 2, 0, 0)]),
        (2, 1, True, [(0, 1, 2, 1), (1, 1, 2, 1), (1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 0, 1), (2, 1, 0, 0)]),
        # accelerator pools: free a slot first, never above the spec count
        (1, 1, False, [(0, 0, 1, 0), (0, 1, 1, 0), (0, 1, 0, 0), (1, 1, 0, 0)]),
    ],
)  # fmt: skip
def test_exact_sequences(
    prefill: int, decode: int, surge: bool, expected: list[tuple[int, int, int, int]]
) -> None:
    assert flat(steps(prefill, decode, surge_prefill=surge, surge_decode=surge)) == expected


def test_exact_sequence_of_two_by_two_accelerator_pools() -> None:
    assert flat(steps(2, 2, surge_prefill=False, surge_decode=False)) == [
        (0, 0, 2, 1),  # an old decode pod drains: its accelerator is free
        (0, 1, 2, 1),  # the first new decode pod
        (0, 1, 1, 1),  # then the prefill pod it carries, in the slot of an old one
        (1, 1, 1, 1),
        (1, 1, 1, 0),
        (1, 2, 1, 0),
        (1, 2, 0, 0),
        (2, 2, 0, 0),
    ]


SIZES = [(p, d) for p in range(0, 6) for d in range(1, 6)] + [(8, 2), (2, 8), (7, 3)]


@pytest.mark.parametrize(("prefill", "decode"), SIZES)
@pytest.mark.parametrize(("surge_prefill", "surge_decode"), list(itertools.product([True, False], repeat=2)))
def test_invariants(prefill: int, decode: int, surge_prefill: bool, surge_decode: bool) -> None:
    sequence = steps(prefill, decode, surge_prefill=surge_prefill, surge_decode=surge_decode)
    states = [(Counts(), Counts(prefill, decode))] + [(s.new, s.old) for s in sequence]
    assert states[-1] == (Counts(prefill, decode), Counts())
    for (new0, old0), (new1, old1) in itertools.pairwise(states):
        changes = [
            abs(a - b)
            for a, b in zip(
                (new0.prefill, new0.decode, old0.prefill, old0.decode),
                (new1.prefill, new1.decode, old1.prefill, old1.decode),
                strict=True,
            )
        ]
        assert sorted(changes) == [0, 0, 0, 1], (new0, old0, new1, old1)  # one pod per state
        assert new1.covers(new0) and old1.within(old0)  # the new grows, the old shrinks
    for new, old in states:
        for pool, spec, surge in (("prefill", prefill, surge_prefill), ("decode", decode, surge_decode)):
            total = getattr(new, pool) + getattr(old, pool)
            low, high = (spec, spec + 1) if surge else (spec - 1, spec)
            assert low <= total <= high, (pool, new, old)
        # decode first: new prefill pods only as many as the new decode pods carry
        assert new.prefill <= math.ceil(new.decode * prefill / decode), (new, old)
        # Each generation's ratio within one pod of the spec's: with spare capacity in both
        # pools |p*D - d*P| <= max(P, D) (one pod of the pool where a pod weighs least); with an
        # accelerator pool, which frees a slot before its successor is Ready, within one pod of
        # each pool.
        bound = max(prefill, decode) if surge_prefill and surge_decode else prefill + decode
        for gen in (new, old):
            assert abs(gen.prefill * decode - gen.decode * prefill) <= bound, (new, old)
        if surge_decode:  # the last old decode pod goes after the last old prefill pod
            assert old.decode > 0 or old.prefill == 0, (new, old)


def observed(new_ready: tuple[int, int], old_present: tuple[int, int]) -> Observed:
    return Observed(new_ready=Counts(*new_ready), old_present=Counts(*old_present))


def applied(new: tuple[int, int], old: tuple[int, int]) -> Step:
    return Step(new=Counts(*new), old=Counts(*old))


SEQUENCE = steps(1, 1)  # (0,1|1,1) (1,1|1,1) (1,1|0,1) (1,1|0,0)


@pytest.mark.parametrize(
    ("seen", "in_force", "index", "step", "done"),
    [
        # the switch: old pods all there, nothing new yet -> a new decode pod
        (observed((0, 0), (1, 1)), applied((0, 0), (1, 1)), 0, applied((0, 1), (1, 1)), False),
        # the new decode pod is not Ready yet: wait (the same state)
        (observed((0, 0), (1, 1)), applied((0, 1), (1, 1)), 0, applied((0, 1), (1, 1)), False),
        # Ready: the new prefill pod starts
        (observed((0, 1), (1, 1)), applied((0, 1), (1, 1)), 1, applied((1, 1), (1, 1)), False),
        # new prefill Ready: the old prefill pod drains
        (observed((1, 1), (1, 1)), applied((1, 1), (1, 1)), 2, applied((1, 1), (0, 1)), False),
        # still draining (the pod exists): wait
        (observed((1, 1), (1, 1)), applied((1, 1), (0, 1)), 2, applied((1, 1), (0, 1)), False),
        (observed((1, 1), (0, 1)), applied((1, 1), (0, 1)), 3, applied((1, 1), (0, 0)), False),
        (observed((1, 1), (0, 0)), applied((1, 1), (0, 0)), 4, applied((1, 1), (0, 0)), True),
        # the new decode pod crashed: nothing is scaled back, the old prefill pod is not removed again
        (observed((1, 0), (0, 1)), applied((1, 1), (0, 1)), 0, applied((1, 1), (0, 1)), False),
    ],
)
def test_advance(seen: Observed, in_force: Step, index: int, step: Step, done: bool) -> None:
    decision = advance(SEQUENCE, seen, in_force)
    assert (decision.index, decision.step, decision.done, decision.total) == (index, step, done, 4)


def test_advance_caps_the_new_generation_at_a_lowered_target() -> None:
    """The spec's replicas went down mid-rollout (2:2 -> 1:1): the new generation is capped."""
    decision = advance(steps(1, 1), observed((0, 1), (2, 2)), applied((2, 2), (2, 2)))
    assert decision.step == applied((1, 1), (1, 1))
