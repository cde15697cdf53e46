"""Pod choice tables."""

from __future__ import annotations

import re

import pytest

from baton_engine.router.policy import (
    Candidate,
    PrefillWeights,
    choose_decode,
    choose_prefill,
    outstanding,
    prefill_score,
    rank_decode,
    rank_prefill,
)

C = Candidate


def test_prefill_score_is_the_weighted_difference() -> None:
    weights = PrefillWeights(prefix=1.0, load=256.0, block_size=16)
    # 32 cached blocks = 512 tokens; outstanding = waiting + running = 3
    assert prefill_score(C("a", prefix_blocks=32, waiting=1, running=2), weights) == 512 - 3 * 256
    # the router's own in-flight count wins over a stale, lower scrape
    assert outstanding(C("a", waiting=0, running=1, in_flight=4)) == 4
    assert prefill_score(C("a", waiting=0, running=1, in_flight=4), weights) == -4 * 256
    # unknown load: only the in-flight requests count (such pods rank last anyway)
    assert outstanding(C("a", in_flight=2)) is None
    assert prefill_score(C("a", prefix_blocks=1, in_flight=2), weights) == 16 - 2 * 256
    assert prefill_score(C("a", prefix_blocks=2, waiting=5, running=0), PrefillWeights(2.0, 0.0, 8)) == 32


Z = {"waiting": 0, "running": 0}  # an idle pod


@pytest.mark.parametrize(
    ("candidates", "weights", "chosen"),
    [
        # default weights (1 per token, 256 per request): 512 cached tokens are worth 2 requests
        ([C("a", prefix_blocks=32, waiting=1, running=0), C("b", **Z)], PrefillWeights(), "a"),
        ([C("a", prefix_blocks=32, waiting=2, running=1), C("b", **Z)], PrefillWeights(), "b"),
        # exactly 2 more requests: equal scores, the key order decides (turn 0)
        ([C("b", prefix_blocks=32, waiting=1, running=1), C("a", **Z)], PrefillWeights(), "a"),
        ([C("a", prefix_blocks=32, waiting=1, running=1), C("b", **Z)], PrefillWeights(), "a"),
        # the router's in-flight requests count as load when the scrape shows fewer
        ([C("a", prefix_blocks=16, waiting=0, running=0, in_flight=2), C("b", **Z)], PrefillWeights(), "b"),
        # a longer prefix wins at equal load, a lower load at equal prefix
        ([C("a", prefix_blocks=2, **Z), C("b", prefix_blocks=5, **Z)], PrefillWeights(), "b"),
        ([C("a", prefix_blocks=3, waiting=4, running=0), C("b", prefix_blocks=3, waiting=1, running=0)],
         PrefillWeights(), "b"),
        ([C("a", waiting=0, running=8), C("b", waiting=0, running=2)], PrefillWeights(), "b"),
        # no load weight: the lexicographic "longest prefix whatever the queue"
        ([C("a", prefix_blocks=2, waiting=90, running=9), C("b", prefix_blocks=1, **Z)],
         PrefillWeights(load=0.0), "a"),
        # no prefix weight: least loaded whatever the cache
        ([C("a", prefix_blocks=64, waiting=1, running=0), C("b", **Z)], PrefillWeights(prefix=0.0), "b"),
        # a heavier prefix weight keeps the traffic on the cached pod longer
        ([C("a", prefix_blocks=32, waiting=3, running=0), C("b", **Z)], PrefillWeights(prefix=2.0), "a"),
        ([C("a", prefix_blocks=32, waiting=5, running=0), C("b", **Z)], PrefillWeights(prefix=2.0), "b"),
        # block size converts cached blocks to tokens
        ([C("a", prefix_blocks=8, waiting=1, running=0), C("b", **Z)], PrefillWeights(block_size=64), "a"),
        ([C("a", prefix_blocks=8, waiting=1, running=0), C("b", **Z)], PrefillWeights(block_size=16), "b"),
        # equal score: fewer requests in flight from this router
        ([C("a", waiting=2, running=0, in_flight=1), C("b", waiting=2, running=0)], PrefillWeights(), "b"),
        # unknown load ranks after any known load, even a long prefix and a long queue
        ([C("a", prefix_blocks=64), C("b", waiting=50, running=50)], PrefillWeights(), "b"),
        ([C("a"), C("b", prefix_blocks=2)], PrefillWeights(), "b"),
        # a full tie at turn 0 goes to the smallest key, whatever the input order
        ([C("c", waiting=1, running=0), C("a", waiting=1, running=0), C("b", waiting=1, running=0)],
         PrefillWeights(), "a"),
        ([C("only")], PrefillWeights(), "only"),
    ],
)  # fmt: skip
def test_prefill_choice(candidates: list[Candidate], weights: PrefillWeights, chosen: str) -> None:
    assert choose_prefill(candidates, weights=weights).key == chosen


def test_rank_prefill_orders_every_candidate() -> None:
    ranked = rank_prefill(
        [
            C("cold", **Z),
            C("hot-busy", prefix_blocks=32, waiting=4, running=1),
            C("hot", prefix_blocks=32, waiting=0, running=1),
            C("unknown", prefix_blocks=32),
        ]
    )
    # hot 512-256, cold 0, hot-busy 512-5*256, unknown last
    assert [c.key for c in ranked] == ["hot", "cold", "hot-busy", "unknown"]


@pytest.mark.parametrize(
    ("prefix", "load", "block_size", "message"),
    [
        (-1.0, 1.0, 16, "prefix_weight: must be a finite number >= 0, got -1.0"),
        (1.0, float("inf"), 16, "load_weight: must be a finite number >= 0, got inf"),
        (1.0, float("nan"), 16, "load_weight: must be a finite number >= 0, got nan"),
        (1.0, 1.0, 0, "block_size: must be positive, got 0"),
    ],
)
def test_bad_weights_are_refused(prefix: float, load: float, block_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PrefillWeights(prefix=prefix, load=load, block_size=block_size)


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
    tied = [C("c", **Z), C("a", **Z), C("b", **Z)]
    assert [choose_prefill(tied, turn=t).key for t in range(4)] == ["a", "b", "c", "a"]
    assert [choose_decode(tied, turn=t).key for t in range(3)] == ["a", "b", "c"]
    # rotation only breaks ties: a better pod wins on every turn
    better = [*tied, C("d", prefix_blocks=1, **Z)]
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


def test_router_settings_carry_the_weights() -> None:
    from baton_engine.router.settings import RouterSettings

    settings = RouterSettings(prefix_weight=2.0, load_weight=3.0, block_size=32)
    assert settings.prefill_weights == PrefillWeights(prefix=2.0, load=3.0, block_size=32)
    assert RouterSettings().prefill_weights == PrefillWeights(prefix=1.0, load=256.0, block_size=16)
    with pytest.raises(ValueError, match="load_weight: must be a finite number >= 0, got -1.0"):
        RouterSettings(load_weight=-1.0)
