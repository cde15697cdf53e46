"""The policy over time (simulated): oscillating load, history bookkeeping, invariants, bad specs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import (
    AutoscalingPolicy,
    Decision,
    History,
    Observations,
    PodSample,
    RatioBounds,
    Recommendation,
    ScaleAction,
    ScaleToZero,
    StepPolicy,
)

from .factories import (
    GPU_REASON,
    NOW,
    decode_pool,
    observe,
    pending,
    policy,
    prefill_pool,
    recs,
    sample,
    scaled_down,
    unknown,
)

INTERVAL = 15.0


def simulate(
    pol: AutoscalingPolicy, load: Callable[[float], float], *, end: float, start_replicas: int = 1
) -> list[Decision]:
    """Drive the policy every INTERVAL s; the pool's replicas follow each decision at once."""
    replicas = {"prefill": start_replicas}
    hist = History()
    decisions = []
    t = 0.0
    while t <= end:
        n = replicas["prefill"]
        samples = tuple(sample(f"p{i}", waiting=load(t) / n, at=t) for i in range(n))
        decision, hist = decide(pol, observe(dict(replicas), *samples), hist, t)
        replicas = decision.desired
        decisions.append(decision)
        t += INTERVAL
    return decisions


def actions(decisions: list[Decision]) -> list[tuple[float, str, int, int]]:
    out = []
    for d in decisions:
        r = d.role("prefill")
        if r.action != "hold":
            out.append((d.at, r.action, r.current, r.desired))
    return out


def test_fast_oscillation_never_scales_down_until_it_stops() -> None:
    # 45 s at 20 waiting, 45 s idle, for 10 minutes; a 60 s window always holds a busy tick.
    def load(t: float) -> float:
        return 20.0 if t < 600 and (t // 45) % 2 == 0 else 0.0

    got = actions(simulate(policy(), load, end=1200))
    # Last busy tick at 570 s: its recommendation leaves the window after 630 s; then one step
    # (maxStep 1) per 60 s window down to minReplicas.
    assert got == [
        (0.0, "up", 1, 3),
        (15.0, "up", 3, 5),
        (645.0, "down", 5, 4),
        (705.0, "down", 4, 3),
        (765.0, "down", 3, 2),
        (825.0, "down", 2, 1),
    ]


def test_slow_oscillation_scales_down_at_most_once_per_window() -> None:
    # 120 s busy / 120 s idle: every idle phase is long enough for one scale-down, never two.
    def load(t: float) -> float:
        return 20.0 if (t // 120) % 2 == 0 else 0.0

    got = actions(simulate(policy(), load, end=960))
    downs = [t for t, action, _, _ in got if action == "down"]
    assert downs == [180.0, 420.0, 660.0, 900.0]
    assert all(b - a >= 60 for a, b in zip(downs, downs[1:], strict=False))
    assert [t for t, action, _, _ in got if action == "up"] == [0.0, 15.0, 240.0, 480.0, 720.0, 960.0]


def test_decide_records_the_recommendation_and_prunes_history() -> None:
    old = recs("prefill", (200, 4), (100, 3), (70, 2), (30, 1))
    stale_action = scaled_down("prefill", 100, 4, 3)
    before = History(old, (stale_action,))
    decision, after = decide(
        policy(), observe({"prefill": 3}, sample("p0"), sample("p1"), sample("p2")), before, NOW
    )
    assert decision.role("prefill").action == "down"
    # Window 60 s: records older than that go, except the newest older recommendation (it shows
    # the window was covered); this tick's recommendation and action are added.
    assert after.recommendations == (
        Recommendation(NOW - 70, "prefill", 2),
        Recommendation(NOW - 30, "prefill", 1),
        Recommendation(NOW, "prefill", 1),
    )
    assert after.actions == (ScaleAction(NOW, "prefill", 3, 2),)


def test_a_held_pool_without_data_records_no_recommendation() -> None:
    _, after = decide(policy(), observe({"prefill": 1}, unknown("p0")), History(), NOW)
    assert after == History()


def test_decision_summary_over_pools() -> None:
    pol = policy(prefill_pool(), decode_pool())
    obs = observe(
        {"prefill": 1, "decode": 2},
        sample("p0", waiting=12),
        sample("d0", "decode", kv=0.9),
        sample("d1", "decode", kv=0.9),
        pending=(pending("d2", "decode"),),
    )
    decision, _ = decide(pol, obs, History(), NOW)
    assert decision.action == "up"
    assert decision.desired == {"prefill": 3, "decode": 2}
    assert decision.reason == (
        "prefill: scale up 1 -> 3: recommend 3 (queue depth 12 / target 4 -> 3) | "
        "decode: hold at 2: recommend 3 (KV usage 0.90 x 2 pods / target 0.60 -> 3); scale-up to 3 "
        f"blocked: 1 pod Pending ({GPU_REASON})"
    )
    metrics = decision.role("decode").metrics
    assert metrics is not None
    assert (metrics.ready_pods, metrics.known_pods, metrics.kv_usage) == (2, 2, 0.9)
    assert decision.role("decode").recommended == 3


def test_missing_replicas_for_a_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"^Observations\.replicas: no entry for role 'prefill'$"):
        decide(policy(), Observations(replicas={}), History(), NOW)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: policy(prefill_pool(min_replicas=-1)),
            "PoolPolicy(prefill).min_replicas: must be >= 0, got -1",
        ),
        (
            lambda: policy(prefill_pool(min_replicas=0)),
            "AutoscalingPolicy.pools: min_replicas 0 needs scale_to_zero: ['prefill']",
        ),
        (
            lambda: AutoscalingPolicy(
                pools=(prefill_pool(min_replicas=0), decode_pool()), scale_to_zero=ScaleToZero(300)
            ),
            "AutoscalingPolicy.scale_to_zero: every pool goes to zero together: min_replicas must be 0 "
            "for ['decode']",
        ),
        (
            lambda: AutoscalingPolicy(pools=(prefill_pool(min_replicas=0),), scale_to_zero=ScaleToZero(0)),
            "ScaleToZero.idle_s: must be > 0, got 0",
        ),
        (
            lambda: policy(prefill_pool(min_replicas=3, max_replicas=2)),
            "PoolPolicy(prefill).max_replicas: 2 is below min_replicas 3",
        ),
        (
            lambda: policy(decode_pool(target_kv_usage=1.5)),
            "PoolPolicy(decode).target_kv_usage: is a ratio, must be <= 1, got 1.5",
        ),
        (
            lambda: policy(prefill_pool(target_queue_depth=None)),
            "PoolPolicy(prefill): needs at least one target",
        ),
        (
            lambda: policy(prefill_pool(target_queue_depth=0)),
            "PoolPolicy(prefill).target_queue_depth: must be > 0, got 0",
        ),
        (
            lambda: policy(prefill_pool(scale_up=StepPolicy(0, 0))),
            "PoolPolicy(prefill).scale_up.max_step: must be >= 1, got 0",
        ),
        (
            lambda: policy(prefill_pool(scale_down=StepPolicy(1, -5))),
            "PoolPolicy(prefill).scale_down.stabilization_window_s: must be >= 0, got -5",
        ),
        (
            lambda: policy(prefill_pool(role="router")),
            "PoolPolicy(router).role: must be one of prefill, decode, engine",
        ),
        (
            lambda: policy(prefill_pool(), prefill_pool()),
            "AutoscalingPolicy.pools: duplicate role in ['prefill', 'prefill']",
        ),
        (
            lambda: policy(ratio=RatioBounds(min_prefill_per_decode=3, max_prefill_per_decode=1)),
            "RatioBounds.min_prefill_per_decode: 3 is above max_prefill_per_decode 1",
        ),
        (
            lambda: AutoscalingPolicy(pools=(prefill_pool(),), max_unknown_fraction=1),
            "AutoscalingPolicy.max_unknown_fraction: must be in [0, 1), got 1",
        ),
        (lambda: AutoscalingPolicy(pools=()), "AutoscalingPolicy.pools: must not be empty"),
    ],
)
def test_bad_policy_names_the_field(build: Callable[[], AutoscalingPolicy], message: str) -> None:
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == message


# One tick of a random world: total queue depth, whether one pod's scrape fails, whether a new
# pod is stuck Pending for lack of GPUs.
TICK = st.tuples(st.integers(0, 60), st.booleans(), st.booleans())


@settings(max_examples=60, deadline=None)
@given(ticks=st.lists(TICK, min_size=1, max_size=80), up_window=st.sampled_from([0.0, 30.0]))
def test_invariants_under_random_load(ticks: list[tuple[int, bool, bool]], up_window: float) -> None:
    pool = prefill_pool(scale_up=StepPolicy(2, up_window), scale_down=StepPolicy(2, 60), max_replicas=8)
    pol = policy(pool)
    replicas, hist, downs = 1, History(), []
    for i, (waiting, one_unknown, stuck) in enumerate(ticks):
        now = i * INTERVAL
        samples: list[PodSample] = [
            sample(f"p{k}", waiting=waiting / replicas, at=now) for k in range(replicas)
        ]
        if one_unknown and replicas > 1:
            samples[0] = unknown("p0", at=now)
        held = (pending("p-new"),) if stuck else ()
        decision, hist = decide(pol, observe({"prefill": replicas}, *samples, pending=held), hist, now)
        r = decision.role("prefill")
        assert 1 <= r.desired <= 8
        assert r.action == ("up" if r.desired > replicas else "down" if r.desired < replicas else "hold")
        assert -2 <= r.desired - replicas <= 2
        if stuck:
            assert r.action != "up"
        if one_unknown and replicas > 1:
            assert r.action != "down"
        if r.action == "down":
            downs.append(now)
        replicas = r.desired
    assert all(b - a >= 60 for a, b in zip(downs, downs[1:], strict=False))
