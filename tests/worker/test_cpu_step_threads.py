"""The CPU step thread chooser: which thread count each small step runs on, from measured times."""

from __future__ import annotations

import pytest

from baton_engine.worker.cpu_step_threads import (
    RECHECK_EVERY,
    SMALL_STEP_MAX_TOKENS,
    WARMUP_SAMPLES,
    StepThreadChooser,
    size_group,
)


@pytest.mark.parametrize(("tokens", "group"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_size_groups(tokens: int, group: int) -> None:
    assert size_group(tokens) == group


def _run(chooser: StepThreadChooser, tokens: int, steps: int, seconds: dict[int, float]) -> list[int]:
    """Run `steps` steps of `tokens` tokens, each taking `seconds[threads]`; the counts used."""
    used = []
    for _ in range(steps):
        threads = chooser.threads_for(tokens)
        chooser.record(tokens, threads, seconds[threads])
        used.append(threads)
    return used


def test_warm_up_alternates_then_picks_the_faster_count_and_rechecks_the_other() -> None:
    chooser = StepThreadChooser(2)
    used = _run(chooser, 1, 2 * WARMUP_SAMPLES, {1: 0.020, 2: 0.025})
    assert used == [2, 1, 2, 1, 2, 1]
    assert chooser.chosen(1) == 1
    used = _run(chooser, 1, 2 * RECHECK_EVERY, {1: 0.020, 2: 0.025})
    # Steps are counted from the group's first: step 16 and step 32 (indexes 15, 31) re-check.
    rechecks = [i + 2 * WARMUP_SAMPLES for i, n in enumerate(used) if n == 2]
    assert rechecks == [RECHECK_EVERY - 1, 2 * RECHECK_EVERY - 1]


def test_the_choice_follows_a_change_of_conditions() -> None:
    chooser = StepThreadChooser(4)
    _run(chooser, 2, 2 * WARMUP_SAMPLES, {1: 0.020, 4: 0.030})
    assert chooser.chosen(2) == 1
    # Every thread becomes the faster (a longer context, say): the re-checks bring it back.
    _run(chooser, 2, 5 * RECHECK_EVERY, {1: 0.040, 4: 0.030})
    assert chooser.chosen(2) == 4
    assert chooser.threads_for(2) == 4


def test_groups_are_measured_apart_and_ties_go_to_every_thread() -> None:
    chooser = StepThreadChooser(2)
    _run(chooser, 1, 2 * WARMUP_SAMPLES, {1: 0.010, 2: 0.020})
    assert chooser.chosen(1) == 1
    assert chooser.chosen(8) is None
    _run(chooser, 7, 2 * WARMUP_SAMPLES, {1: 0.020, 2: 0.020})
    assert chooser.chosen(8) == 2
    assert chooser.chosen(5) == 2  # 5..8 tokens share a group


def test_large_steps_and_one_thread_are_left_alone() -> None:
    chooser = StepThreadChooser(2)
    assert chooser.threads_for(SMALL_STEP_MAX_TOKENS + 1) == 2
    chooser.record(SMALL_STEP_MAX_TOKENS + 1, 1, 0.001)
    assert chooser.chosen(SMALL_STEP_MAX_TOKENS + 1) == 2
    single = StepThreadChooser(1)
    assert _run(single, 1, 10, {1: 0.01}) == [1] * 10
    with pytest.raises(ValueError, match="all_threads must be >= 1, got 0"):
        StepThreadChooser(0)
