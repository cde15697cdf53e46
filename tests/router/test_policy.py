"""Pod choice tables."""

from __future__ import annotations

import pytest

from baton_engine.router.policy import Candidate, choose_decode, choose_prefill, rank_decode

C = Candidate


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        # longest cached prefix wins over load
        ([C("a", prefix_blocks=2, waiting=9), C("b", prefix_blocks=5, waiting=30)], "b"),
        # equal prefix: fewer waiting requests
        ([C("a", prefix_blocks=3, waiting=4), C("b", prefix_blocks=3, waiting=1)], "b"),
        # equal prefix and waiting: fewer running
        ([C("a", waiting=0, running=8), C("b", waiting=0, running=2)], "b"),
        # then fewer requests in flight from this router
        ([C("a", waiting=0, running=0, in_flight=3), C("b", waiting=0, running=0, in_flight=1)], "b"),
        # unknown load ranks after any known load
        ([C("a"), C("b", waiting=50, running=50)], "b"),
        # a full tie at turn 0 goes to the smallest key, whatever the input order
        ([C("c", waiting=1), C("a", waiting=1), C("b", waiting=1)], "a"),
        ([C("only")], "only"),
    ],
)
def test_prefill_choice(candidates: list[Candidate], chosen: str) -> None:
    assert choose_prefill(candidates).key == chosen


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        ([C("a", kv_usage=0.7, running=1), C("b", kv_usage=0.2, running=9)], "b"),
        ([C("a", kv_usage=0.5, running=4), C("b", kv_usage=0.5, running=3)], "b"),
        ([C("a", kv_usage=0.5, running=3, in_flight=2), C("b", kv_usage=0.5, running=3, in_flight=0)], "b"),
        ([C("a"), C("b", kv_usage=0.99, running=100)], "b"),
        # prefix hits do not matter for decode (the KV arrives with the transfer)
        ([C("a", prefix_blocks=9, kv_usage=0.3), C("b", kv_usage=0.1)], "b"),
        ([C("b", kv_usage=0.1), C("a", kv_usage=0.1)], "a"),
    ],
)
def test_decode_choice(candidates: list[Candidate], chosen: str) -> None:
    assert choose_decode(candidates).key == chosen


def test_decode_ranking_is_total() -> None:
    ranked = rank_decode([C("x"), C("b", kv_usage=0.5), C("a", kv_usage=0.5), C("c", kv_usage=0.1)])
    assert [c.key for c in ranked] == ["c", "a", "b", "x"]
    ranked = rank_decode([C("x"), C("b", kv_usage=0.5), C("a", kv_usage=0.5), C("c", kv_usage=0.1)], turn=1)
    assert [c.key for c in ranked] == [
        "c",
        "b",
        "a",
        "x",
    ]  # a and b tie: turn 1 starts the key order's rotation at b


def test_full_ties_rotate_with_the_turn() -> None:
    """New prefixes (no pod has them) spread over the pool instead of piling onto one pod."""
    tied = [C("c", waiting=0), C("a", waiting=0), C("b", waiting=0)]
    assert [choose_prefill(tied, turn=t).key for t in range(4)] == ["a", "b", "c", "a"]
    assert [choose_decode(tied, turn=t).key for t in range(3)] == ["a", "b", "c"]
    # rotation only breaks ties: a better pod wins on every turn
    better = [*tied, C("d", prefix_blocks=1, waiting=5)]
    assert {choose_prefill(better, turn=t).key for t in range(4)} == {"d"}


def test_round_robin_walks_keys_in_order_ignoring_state() -> None:
    candidates = [C("b", prefix_blocks=9), C("a", waiting=100), C("c")]
    assert [choose_prefill(candidates, "round-robin", turn).key for turn in range(5)] == [
        "a",
        "b",
        "c",
        "a",
        "b",
    ]
    assert [choose_decode(candidates, "round-robin", turn).key for turn in range(4)] == ["a", "b", "c", "a"]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="choose_prefill: no candidates"):
        choose_prefill([])
    with pytest.raises(ValueError, match="choose_decode: no candidates"):
        choose_decode([])
