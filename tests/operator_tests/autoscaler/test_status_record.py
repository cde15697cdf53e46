"""Decision and history as status JSON; the history survives a round trip (operator restarts)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from baton_operator.autoscaler.policy import decide
from baton_operator.autoscaler.policy_types import History, Recommendation, ScaleAction
from baton_operator.autoscaler.status_record import (
    decision_status,
    history_from_dict,
    history_to_dict,
    material_change,
    status_summary,
)

from .factories import NOW, decode_pool, observe, policy, prefill_pool, sample, steady, unknown


def test_decision_status_shape() -> None:
    pol = policy(prefill_pool(), decode_pool())
    obs = observe({"prefill": 1, "decode": 1}, sample("p0", waiting=9), unknown("d0", "decode"))
    decision, _ = decide(pol, obs, History(), NOW)
    status = json.loads(json.dumps(decision_status(decision)))
    assert status == {
        "time": "1970-01-01T02:46:40.000000Z",
        "action": "up",
        "reason": decision.reason,
        "pools": {
            "prefill": {
                "currentReplicas": 1,
                "desiredReplicas": 3,
                "recommendedReplicas": 3,
                "action": "up",
                "reason": "scale up 1 -> 3: recommend 3 (queue depth 9 / target 4 -> 3)",
                "metrics": {
                    "readyPods": 1,
                    "knownPods": 1,
                    "unknownPods": 0,
                    "stalePods": 0,
                    "waitingRequests": 9.0,
                    "runningRequests": 0.0,
                    "kvUsage": 0.0,
                    "queuedPromptTokens": None,
                    "oldestSampleAgeSeconds": 0.0,
                },
            },
            "decode": {
                "currentReplicas": 1,
                "desiredReplicas": 1,
                "recommendedReplicas": None,
                "action": "hold",
                "reason": "hold at 1: no usable metrics from 1 of 1 ready pod (1 unknown), "
                "above the 50% limit",
                "metrics": {
                    "readyPods": 1,
                    "knownPods": 0,
                    "unknownPods": 1,
                    "stalePods": 0,
                    "waitingRequests": None,
                    "runningRequests": None,
                    "kvUsage": None,
                    "queuedPromptTokens": None,
                    "oldestSampleAgeSeconds": 0.0,
                },
            },
        },
    }


def test_status_summary_is_flat() -> None:
    pol = policy(prefill_pool(), decode_pool())
    obs = observe({"prefill": 1, "decode": 1}, sample("p0", waiting=9), unknown("d0", "decode"))
    decision, _ = decide(pol, obs, History(), NOW)
    assert status_summary(decision) == {
        "lastDecision": {"prefill": 3, "decode": 1},
        "reason": decision.reason,
        "metrics": {
            "prefill.readyPods": 1.0,
            "prefill.knownPods": 1.0,
            "prefill.unknownPods": 0.0,
            "prefill.stalePods": 0.0,
            "prefill.waitingRequests": 9.0,
            "prefill.runningRequests": 0.0,
            "prefill.kvUsage": 0.0,
            "prefill.oldestSampleAgeSeconds": 0.0,
            "decode.readyPods": 1.0,
            "decode.knownPods": 0.0,
            "decode.unknownPods": 1.0,
            "decode.stalePods": 0.0,
            "decode.oldestSampleAgeSeconds": 0.0,
        },
        "time": "1970-01-01T02:46:40.000000Z",
    }


def test_history_round_trips_through_json_and_keeps_the_window() -> None:
    pol = policy()
    # A restarted operator that reloads its history scales down at once; one without history waits.
    hist = History(steady("prefill", 1), (ScaleAction(NOW - 200, "prefill", 3, 2),))
    reloaded = history_from_dict(json.loads(json.dumps(history_to_dict(hist))))
    assert reloaded == hist
    obs = observe({"prefill": 2}, sample("p0"), sample("p1"))
    assert decide(pol, obs, reloaded, NOW)[0].role("prefill").action == "down"
    assert decide(pol, obs, History(), NOW)[0].role("prefill").action == "hold"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "history: must be an object"),
        ({"recommendations": {}}, "history.recommendations: must be a list"),
        ({"actions": 3}, "history.actions: must be a list"),
        ({"recommendations": [[1.0, "prefill"]]}, "history.recommendations[0]: must be a list of 3 items"),
        (
            {"recommendations": [["x", "prefill", 2]]},
            "history.recommendations[0][0]: must be a unix time, got 'x'",
        ),
        ({"recommendations": [[1.0, 7, 2]]}, "history.recommendations[0][1]: must be a role name, got 7"),
        ({"actions": [[1.0, "decode", 2, -1]]}, "history.actions[0][3]: must be a replica count, got -1"),
        ({"actions": [[1.0, "decode", True, 1]]}, "history.actions[0][2]: must be a replica count, got True"),
    ],
)
def test_malformed_history_names_the_entry(raw: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        history_from_dict(raw)
    assert str(info.value) == message


def test_history_entries_are_sorted_by_time() -> None:
    raw = {"recommendations": [[20.0, "prefill", 2], [10.0, "prefill", 1]], "actions": []}
    assert history_from_dict(raw).recommendations == (
        Recommendation(10.0, "prefill", 1),
        Recommendation(20.0, "prefill", 2),
    )


STORED: dict[str, Any] = {
    "lastDecision": {"prefill": 1, "decode": 2},
    "currentReplicas": {"prefill": 1, "decode": 2},
    "action": "hold",
    "reason": "prefill: hold at 1 ...",
    "metrics": {"prefill.waitingRequests": 0.0, "decode.kvUsage": 0.41, "decode.readyPods": 2.0},
    "time": "2026-01-01T00:00:00.000000Z",
    "history": json.dumps({"recommendations": [[1.0, "decode", 2]], "actions": [[0.5, "decode", 1, 2]]}),
}
T0 = 1767225600.0  # 2026-01-01T00:00:00Z
#: A stored decision whose oldest decode sample was 2 ms old at the decision.
SAMPLED: dict[str, Any] = {
    **STORED,
    "metrics": {**STORED["metrics"], "decode.oldestSampleAgeSeconds": 0.002, "decode.stalePods": 0.0},
}


def fresh(**changes: Any) -> dict[str, Any]:
    out = {**STORED, "metrics": {**STORED["metrics"]}, "time": "2026-01-01T00:00:30.000000Z"}
    out["history"] = json.dumps(
        {"recommendations": [[1.0, "decode", 2], [30.0, "decode", 2]], "actions": [[0.5, "decode", 1, 2]]}
    )
    for key, value in changes.items():
        if key == "metrics":
            out["metrics"].update(value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("stored", "new", "now", "why"),
    [
        ({}, fresh(), T0, "first decision"),
        (STORED, fresh(), T0 + 30, None),  # new recommendations, same decision: nothing to write
        (STORED, fresh(reason="prefill: hold at 1 (other words)"), T0 + 30, None),
        (STORED, fresh(metrics={"decode.kvUsage": 0.45}), T0 + 30, None),  # within 0.05
        (STORED, fresh(metrics={"decode.kvUsage": 0.47}), T0 + 30, "metrics decode.kvUsage"),
        # The scrape's latency, not the load: a busy engine answering 0.9 s later is no news.
        (SAMPLED, fresh(metrics={**SAMPLED["metrics"], "decode.oldestSampleAgeSeconds": 0.9}), T0 + 30, None),
        (
            SAMPLED,
            fresh(
                metrics={**SAMPLED["metrics"], "decode.oldestSampleAgeSeconds": 61.0, "decode.stalePods": 1.0}
            ),
            T0 + 30,
            "metrics decode.stalePods",
        ),
        (STORED, fresh(metrics={"prefill.waitingRequests": 1.0}), T0 + 30, "metrics prefill.waitingRequests"),
        (STORED, fresh(metrics={"decode.readyPods": 3.0}), T0 + 30, "metrics decode.readyPods"),
        (STORED, fresh(metrics={"decode.stalePods": 1.0}), T0 + 30, "metrics reported"),
        (STORED, fresh(lastDecision={"prefill": 2, "decode": 2}), T0 + 30, "lastDecision"),
        (STORED, fresh(currentReplicas={"prefill": 1, "decode": 3}), T0 + 30, "currentReplicas"),
        (STORED, fresh(action="up"), T0 + 30, "action"),
        (
            STORED,
            fresh(
                history=json.dumps(
                    {"recommendations": [], "actions": [[0.5, "decode", 1, 2], [30.0, "decode", 2, 1]]}
                )
            ),
            T0 + 30,
            "scale actions",
        ),
        (STORED, fresh(), T0 + 60, "heartbeat"),
        ({**STORED, "time": None}, fresh(), T0 + 30, "heartbeat"),
    ],
)
def test_what_counts_as_a_material_change(
    stored: dict[str, Any], new: dict[str, Any], now: float, why: str | None
) -> None:
    assert material_change(stored, new, now) == why
