"""The autoscaling policy, case by case, on simulated time: exact desired replicas, action and reason."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import (
    AutoscalingPolicy,
    History,
    Observations,
    PodSample,
    PoolPolicy,
    RatioBounds,
    StepPolicy,
)

from .factories import (
    DOWN,
    GPU_REASON,
    NOW,
    UP,
    decode_pool,
    history,
    observe,
    pending,
    policy,
    prefill_pool,
    recs,
    sample,
    scaled_down,
    steady,
    unknown,
)

IDLE_TO_MIN = "queue depth 0 / target 4 -> 0, raised to minReplicas 1"


@dataclass(frozen=True)
class Case:
    id: str
    policy: AutoscalingPolicy
    observations: Observations
    history: History
    expect: dict[str, tuple[int, str, str]]  # role -> (desired, action, reason)


def _idle(n: int, role: str = "prefill") -> tuple[PodSample, ...]:
    return tuple(sample(f"{role}-{i}", role) for i in range(n))


def _busy(n: int, waiting: float) -> tuple[PodSample, ...]:
    return tuple(sample(f"prefill-{i}", waiting=waiting) for i in range(n))


def _kv(n: int, kv: float, running: float = 0) -> tuple[PodSample, ...]:
    return tuple(sample(f"decode-{i}", "decode", kv=kv, running=running) for i in range(n))


P = policy()
EMPTY = History()
AGGREGATED = AutoscalingPolicy(
    pools=(
        PoolPolicy(
            role="engine",
            min_replicas=1,
            max_replicas=4,
            scale_up=UP,
            scale_down=DOWN,
            target_queue_depth=4,
            target_kv_usage=0.6,
        ),
    )
)
SLOW_UP = policy(prefill_pool(scale_up=StepPolicy(2, 30)))
#: The load of the two up-window cases, which differ only in the history before it.
QUEUE_OF_12_ON_1 = observe({"prefill": 1}, sample("p0", waiting=12))
RECOMMEND_3 = "recommend 3 (queue depth 12 / target 4 -> 3)"
BIG_DOWN = policy(prefill_pool(scale_down=StepPolicy(3, 60)))
TOKENS = policy(prefill_pool(target_queued_tokens=2048))
BOTH = policy(prefill_pool(), decode_pool())

CASES = [
    Case(
        "steady load holds",
        P,
        observe({"prefill": 2}, sample("p0", waiting=3), sample("p1", waiting=4)),
        history(steady("prefill", 2)),
        {"prefill": (2, "hold", "hold at 2: recommend 2 (queue depth 7 / target 4 -> 2)")},
    ),
    Case(
        "queue depth scales up at once",
        P,
        observe({"prefill": 1}, sample("p0", waiting=9)),
        EMPTY,
        {"prefill": (3, "up", "scale up 1 -> 3: recommend 3 (queue depth 9 / target 4 -> 3)")},
    ),
    Case(
        "scale-up limited by maxStep",
        P,
        observe({"prefill": 1}, sample("p0", waiting=20)),
        EMPTY,
        {
            "prefill": (
                3,
                "up",
                "scale up 1 -> 3: recommend 5 (queue depth 20 / target 4 -> 5); limited by maxStep 2",
            )
        },
    ),
    Case(
        "recommendation capped at maxReplicas",
        P,
        observe({"prefill": 4}, *_busy(4, 10)),
        EMPTY,
        {
            "prefill": (
                6,
                "up",
                "scale up 4 -> 6: recommend 6 (queue depth 40 / target 4 -> 10, capped at maxReplicas 6)",
            )
        },
    ),
    Case(
        "idle pool is kept at minReplicas",
        policy(prefill_pool(min_replicas=2)),
        observe({"prefill": 2}, *_idle(2)),
        history(steady("prefill", 2)),
        {
            "prefill": (
                2,
                "hold",
                "hold at 2: recommend 2 (queue depth 0 / target 4 -> 0, raised to minReplicas 2)",
            )
        },
    ),
    Case(
        "below minReplicas is raised at once",
        policy(prefill_pool(min_replicas=3)),
        observe({"prefill": 1}, *_idle(1)),
        EMPTY,
        {"prefill": (3, "up", "scale up 1 -> 3: below minReplicas 3")},
    ),
    Case(
        "above maxReplicas is lowered at once",
        P,
        observe({"prefill": 9}, *_idle(9)),
        EMPTY,
        {"prefill": (6, "down", "scale down 9 -> 6: above maxReplicas 6")},
    ),
    Case(
        "scale-down after a full window, one step",
        P,
        observe({"prefill": 3}, *_idle(3)),
        history(steady("prefill", 1)),
        {
            "prefill": (
                2,
                "down",
                f"scale down 3 -> 2: recommend 1 ({IDLE_TO_MIN}); highest in the last 60s: 1; "
                "limited by maxStep 1",
            )
        },
    ),
    Case(
        "scale-down by a larger maxStep",
        BIG_DOWN,
        observe({"prefill": 3}, *_idle(3)),
        history(steady("prefill", 1)),
        {
            "prefill": (
                1,
                "down",
                f"scale down 3 -> 1: recommend 1 ({IDLE_TO_MIN}); highest in the last 60s: 1",
            )
        },
    ),
    Case(
        "scale-down goes to the highest recommendation in the window",
        BIG_DOWN,
        observe({"prefill": 4}, *_idle(4)),
        history(recs("prefill", (90, 4), (45, 2), (15, 1))),
        {
            "prefill": (
                2,
                "down",
                f"scale down 4 -> 2: recommend 1 ({IDLE_TO_MIN}); highest in the last 60s: 2",
            )
        },
    ),
    Case(
        "a recent high recommendation holds the scale-down",
        P,
        observe({"prefill": 2}, *_idle(2)),
        history(recs("prefill", (90, 1), (30, 2))),
        {"prefill": (2, "hold", f"hold at 2: recommend 1 ({IDLE_TO_MIN}); highest in the last 60s: 2")},
    ),
    Case(
        "scale-down waits until the history covers the window",
        P,
        observe({"prefill": 2}, *_idle(2)),
        history(recs("prefill", (30, 1), (15, 1))),
        {
            "prefill": (
                2,
                "hold",
                f"hold at 2: recommend 1 ({IDLE_TO_MIN}); scale-down waits for 60s of recommendations "
                "(have 30s)",
            )
        },
    ),
    Case(
        "no scale-down right after a restart (empty history)",
        P,
        observe({"prefill": 2}, *_idle(2)),
        EMPTY,
        {
            "prefill": (
                2,
                "hold",
                f"hold at 2: recommend 1 ({IDLE_TO_MIN}); scale-down waits for 60s of recommendations "
                "(have 0s)",
            )
        },
    ),
    Case(
        "at most one scale-down per window",
        P,
        observe({"prefill": 2}, *_idle(2)),
        history(steady("prefill", 1), actions=(scaled_down("prefill", 30, 3, 2),)),
        {
            "prefill": (
                2,
                "hold",
                f"hold at 2: recommend 1 ({IDLE_TO_MIN}); last scale-down 30s ago, next after 60s",
            )
        },
    ),
    Case(
        "an up-window ignores a short spike",
        SLOW_UP,
        QUEUE_OF_12_ON_1,
        history(recs("prefill", (20, 1), (10, 3))),
        {"prefill": (1, "hold", f"hold at 1: {RECOMMEND_3}; lowest in the last 30s: 1")},
    ),
    Case(
        "an up-window follows a sustained rise to its lowest value",
        SLOW_UP,
        QUEUE_OF_12_ON_1,
        history(recs("prefill", (20, 2), (10, 3))),
        {"prefill": (2, "up", f"scale up 1 -> 2: {RECOMMEND_3}; lowest in the last 30s: 2")},
    ),
    Case(
        "a pod Pending for lack of GPUs blocks scale-up",
        P,
        observe({"prefill": 2}, sample("p0", waiting=20), pending=(pending("p1"),)),
        EMPTY,
        {
            "prefill": (
                2,
                "hold",
                "hold at 2: recommend 5 (queue depth 20 / target 4 -> 5); scale-up to 5 blocked: "
                f"1 pod Pending ({GPU_REASON})",
            )
        },
    ),
    Case(
        "a scheduled pod still being created does not block scale-up",
        P,
        observe({"prefill": 2}, sample("p0", waiting=20), pending=(pending("p1", unschedulable=False),)),
        EMPTY,
        {
            "prefill": (
                4,
                "up",
                "scale up 2 -> 4: recommend 5 (queue depth 20 / target 4 -> 5); limited by maxStep 2",
            )
        },
    ),
    Case(
        "a Pending pod does not block scale-down",
        P,
        observe({"prefill": 3}, *_idle(2), pending=(pending("p2"),)),
        history(steady("prefill", 1)),
        {
            "prefill": (
                2,
                "down",
                f"scale down 3 -> 2: recommend 1 ({IDLE_TO_MIN}); highest in the last 60s: 1; "
                "limited by maxStep 1",
            )
        },
    ),
    Case(
        "all metrics unknown: hold, never read as zero",
        P,
        observe({"prefill": 2}, unknown("p0"), unknown("p1", error="timeout after 2s")),
        history(steady("prefill", 1)),
        {
            "prefill": (
                2,
                "hold",
                "hold at 2: no usable metrics from 2 of 2 ready pods (2 unknown), above the 50% limit",
            )
        },
    ),
    Case(
        "an unknown minority is assumed at the known mean",
        P,
        observe({"prefill": 3}, sample("p0", waiting=6), sample("p1", waiting=6), unknown("p2")),
        EMPTY,
        {
            "prefill": (
                5,
                "up",
                "scale up 3 -> 5: recommend 5 (queue depth 18 / target 4 -> 5, "
                "1 of 3 ready pods unknown, assumed at the known mean)",
            )
        },
    ),
    Case(
        "an unknown pod holds scale-down",
        P,
        observe({"prefill": 3}, *_idle(2), unknown("p2")),
        history(steady("prefill", 1)),
        {
            "prefill": (
                3,
                "hold",
                "hold at 3: recommend 1 (queue depth 0 / target 4 -> 0, 1 of 3 ready pods unknown, "
                "assumed at the known mean, raised to minReplicas 1); "
                "scale-down held while 1 of 3 ready pods are unknown",
            )
        },
    ),
    Case(
        "stale data is not acted on",
        P,
        observe(
            {"prefill": 2}, sample("p0", waiting=20, at=NOW - 120), sample("p1", waiting=20, at=NOW - 61)
        ),
        EMPTY,
        {
            "prefill": (
                2,
                "hold",
                "hold at 2: no usable metrics from 2 of 2 ready pods (2 older than 60s), above the 50% limit",
            )
        },
    ),
    Case(
        "stale and unknown pods together exceed the limit",
        P,
        observe(
            {"prefill": 3}, sample("p0", waiting=20), sample("p1", waiting=20, at=NOW - 90), unknown("p2")
        ),
        EMPTY,
        {
            "prefill": (
                3,
                "hold",
                "hold at 3: no usable metrics from 2 of 3 ready pods (1 unknown, 1 older than 60s), "
                "above the 50% limit",
            )
        },
    ),
    Case(
        "no ready pods: nothing to measure",
        P,
        observe({"prefill": 2}, sample("p0", waiting=9, ready=False), sample("p1", ready=False)),
        EMPTY,
        {"prefill": (2, "hold", "hold at 2: no ready pods to measure")},
    ),
    Case(
        "unready pods do not count",
        P,
        observe({"prefill": 2}, sample("p0", waiting=4), sample("p1", waiting=100, ready=False)),
        history(steady("prefill", 2)),
        {
            "prefill": (
                2,
                "hold",
                "hold at 2: recommend 1 (queue depth 4 / target 4 -> 1); highest in the last 60s: 2",
            )
        },
    ),
    Case(
        "decode grows with KV usage (HPA ratio, no float overshoot)",
        policy(decode_pool()),
        observe({"decode": 2}, *_kv(2, 0.9)),
        EMPTY,
        {"decode": (3, "up", "scale up 2 -> 3: recommend 3 (KV usage 0.90 x 2 pods / target 0.60 -> 3)")},
    ),
    Case(
        "decode also follows running requests",
        policy(decode_pool(target_running_requests=8)),
        observe({"decode": 2}, *_kv(2, 0.3, running=10)),
        EMPTY,
        {
            "decode": (
                3,
                "up",
                "scale up 2 -> 3: recommend 3 (KV usage 0.30 x 2 pods / target 0.60 -> 1, "
                "running requests 20 / target 8 -> 3)",
            )
        },
    ),
    Case(
        "prefill follows queued prompt tokens",
        TOKENS,
        observe({"prefill": 1}, sample("p0", waiting=2, tokens=5000)),
        EMPTY,
        {
            "prefill": (
                3,
                "up",
                "scale up 1 -> 3: recommend 3 (queue depth 2 / target 4 -> 1, "
                "queued prompt tokens 5000 / target 2048 -> 3)",
            )
        },
    ),
    Case(
        "queued prompt tokens not exported: queue depth alone",
        TOKENS,
        observe({"prefill": 1}, sample("p0", waiting=2)),
        history(steady("prefill", 1)),
        {
            "prefill": (
                1,
                "hold",
                "hold at 1: recommend 1 (queue depth 2 / target 4 -> 1, queued prompt tokens not exported)",
            )
        },
    ),
    Case(
        "aggregated pool takes the larger of queue depth and KV usage",
        AGGREGATED,
        observe(
            {"engine": 2},
            sample("e0", "engine", waiting=1, kv=0.8),
            sample("e1", "engine", waiting=1, kv=0.7),
        ),
        EMPTY,
        {
            "engine": (
                3,
                "up",
                "scale up 2 -> 3: recommend 3 (queue depth 2 / target 4 -> 1, KV usage 0.75 x 2 pods / "
                "target 0.60 -> 3)",
            )
        },
    ),
    Case(
        "min prefill:decode ratio raises prefill",
        policy(prefill_pool(), decode_pool(), ratio=RatioBounds(min_prefill_per_decode=0.5)),
        observe({"prefill": 1, "decode": 4}, *_idle(1), *_kv(4, 0.6)),
        history(steady("prefill", 1), steady("decode", 4)),
        {
            "prefill": (
                2,
                "up",
                f"scale up 1 -> 2: recommend 2 ({IDLE_TO_MIN}, raised to 2 by prefill:decode >= 0.5)",
            ),
            "decode": (4, "hold", "hold at 4: recommend 4 (KV usage 0.60 x 4 pods / target 0.60 -> 4)"),
        },
    ),
    Case(
        "max prefill:decode ratio raises decode",
        policy(prefill_pool(), decode_pool(), ratio=RatioBounds(max_prefill_per_decode=2)),
        observe({"prefill": 6, "decode": 1}, *_busy(6, 4), *_kv(1, 0.1)),
        history(steady("prefill", 6), steady("decode", 1)),
        {
            "prefill": (6, "hold", "hold at 6: recommend 6 (queue depth 24 / target 4 -> 6)"),
            "decode": (
                3,
                "up",
                "scale up 1 -> 3: recommend 3 (KV usage 0.10 x 1 pod / target 0.60 -> 1, "
                "raised to 3 by prefill:decode <= 2)",
            ),
        },
    ),
    Case(
        "ratio bound stops at maxReplicas",
        policy(prefill_pool(), decode_pool(), ratio=RatioBounds(min_prefill_per_decode=2)),
        observe({"prefill": 5, "decode": 4}, *_idle(5), *_kv(4, 0.6)),
        history(steady("prefill", 6), steady("decode", 4)),
        {
            "prefill": (
                6,
                "up",
                f"scale up 5 -> 6: recommend 6 ({IDLE_TO_MIN}, raised to 6 by prefill:decode >= 2 "
                "(capped at maxReplicas 6))",
            ),
            "decode": (4, "hold", "hold at 4: recommend 4 (KV usage 0.60 x 4 pods / target 0.60 -> 4)"),
        },
    ),
    Case(
        "pools decide independently: a Pending decode pod does not block prefill",
        BOTH,
        observe(
            {"prefill": 1, "decode": 2},
            sample("p0", waiting=12),
            *_kv(2, 0.9),
            pending=(pending("decode-2", "decode"),),
        ),
        EMPTY,
        {
            "prefill": (3, "up", "scale up 1 -> 3: recommend 3 (queue depth 12 / target 4 -> 3)"),
            "decode": (
                2,
                "hold",
                "hold at 2: recommend 3 (KV usage 0.90 x 2 pods / target 0.60 -> 3); scale-up to 3 blocked: "
                f"1 pod Pending ({GPU_REASON})",
            ),
        },
    ),
    Case(
        "ratio bounds wait while a pool has no data",
        policy(prefill_pool(), decode_pool(), ratio=RatioBounds(min_prefill_per_decode=1)),
        observe({"prefill": 1, "decode": 3}, unknown("p0"), *_kv(3, 0.6)),
        history(steady("decode", 3)),
        {
            "prefill": (
                1,
                "hold",
                "hold at 1: no usable metrics from 1 of 1 ready pod (1 unknown), above the 50% limit",
            ),
            "decode": (3, "hold", "hold at 3: recommend 3 (KV usage 0.60 x 3 pods / target 0.60 -> 3)"),
        },
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_policy_case(case: Case) -> None:
    decision, _ = decide(case.policy, case.observations, case.history, NOW)
    got = {r.role: (r.desired, r.action, r.reason) for r in decision.roles}
    assert got == case.expect
    assert decision.at == NOW


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 25
