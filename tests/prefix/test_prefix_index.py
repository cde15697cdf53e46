"""PrefixIndex: longest-prefix queries, copy counts, clears."""

from __future__ import annotations

from baton_engine.prefix.index import PrefixIndex


def test_longest_prefix_match_per_pod() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3, 4])
    index.store("b", [1, 2, 9])
    index.store("c", [2, 3, 4])  # holds later blocks but not the first: no prefix
    assert index.longest_prefix_match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.longest_prefix_match([1, 2, 9]) == {"a": 2, "b": 3}
    assert index.longest_prefix_match([2, 3]) == {"a": 2, "b": 1, "c": 2}
    assert index.longest_prefix_match([3, 4]) == {"a": 2, "c": 2}
    assert index.longest_prefix_match([7]) == {}
    assert index.longest_prefix_match([]) == {}


def test_a_hash_stored_twice_needs_two_removals() -> None:
    index = PrefixIndex()
    index.store("a", [1, 1, 2])
    index.remove("a", [1])
    assert index.longest_prefix_match([1, 2]) == {"a": 2}
    index.remove("a", [1])
    assert index.longest_prefix_match([1, 2]) == {}
    assert index.block_count("a") == 1


def test_unknown_removals_are_ignored() -> None:
    index = PrefixIndex()
    index.remove("nobody", [1])
    index.store("a", [1])
    index.remove("a", [5])
    assert index.longest_prefix_match([1]) == {"a": 1}


def test_clear_pod_drops_only_that_pod() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2])
    index.store("b", [1, 2])
    index.clear_pod("a")
    assert index.longest_prefix_match([1, 2]) == {"b": 2}
    assert index.pods() == {"b"}
    assert index.block_count("a") == 0
    index.clear_pod("b")
    assert index.pods() == set()
    assert index._holders == {}
