"""A stream chunk names each choice once: when the server falls behind its engine (a loaded
machine), one read holds several outputs of a choice, which are merged into one delta (clients
read ``choices[0]`` as the chunk's delta; two entries for index 0 lost the second's text)."""

from __future__ import annotations

from baton_engine.server.generation import ChoiceDelta, merged_by_choice


def test_outputs_of_one_choice_read_together_are_one_delta() -> None:
    batch = [
        ChoiceDelta(0, "Hel", [7, 8], [[(7, -0.1)], [(8, -0.2)]]),
        ChoiceDelta(1, "A", [3], [[(3, -0.5)]]),
        ChoiceDelta(0, "lo", [9], [[(9, -0.3)]]),
        ChoiceDelta(0, "", [], None, "length"),
        ChoiceDelta(1, "", [], None, "abort", "client gone"),
    ]
    assert merged_by_choice(batch) == [
        ChoiceDelta(0, "Hello", [7, 8, 9], [[(7, -0.1)], [(8, -0.2)], [(9, -0.3)]], "length"),
        ChoiceDelta(1, "A", [3], [[(3, -0.5)]], "abort", "client gone"),
    ]
    assert batch[0] == ChoiceDelta(0, "Hel", [7, 8], [[(7, -0.1)], [(8, -0.2)]])  # inputs left as they were


def test_a_batch_of_distinct_choices_is_unchanged() -> None:
    batch = [ChoiceDelta(1, "b", [2], None), ChoiceDelta(0, "a", [1], None, "stop")]
    assert merged_by_choice(batch) == batch
    assert merged_by_choice([]) == []
