"""spec.autoscaling JSON -> AutoscalingPolicy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from baton_operator.autoscaler.policy_types import AutoscalingPolicy, PoolPolicy, RatioBounds, StepPolicy
from baton_operator.autoscaler.spec_adapter import policy_from_spec

# What the CRD's defaults produce (as the API server or model_dump(by_alias=True) returns it).
SPEC: dict[str, Any] = {
    "mode": "builtin",
    "intervalSeconds": 15,
    "metricsSource": "pods",
    "prefill": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4.0},
    "decode": {"minReplicas": 1, "maxReplicas": 4, "targetKVUsage": 0.7},
    "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2},
    "scaleDown": {"stabilizationWindowSeconds": 300, "maxStep": 1},
}
UP, DOWN = StepPolicy(2, 0.0), StepPolicy(1, 300.0)


def test_disaggregated_defaults() -> None:
    assert policy_from_spec(SPEC) == AutoscalingPolicy(
        pools=(
            PoolPolicy("prefill", 1, 4, UP, DOWN, target_queue_depth=4.0),
            PoolPolicy("decode", 1, 4, UP, DOWN, target_kv_usage=0.7),
        ),
        ratio=None,
        max_metric_age_s=45.0,
    )


def test_aggregated_pool_uses_decode_bounds_and_both_signals() -> None:
    spec = copy.deepcopy(SPEC)
    spec["decode"].update(minReplicas=2, maxReplicas=6)
    assert policy_from_spec(spec, "aggregated").pools == (
        PoolPolicy("engine", 2, 6, UP, DOWN, target_queue_depth=4.0, target_kv_usage=0.7),
    )


def test_optional_extensions() -> None:
    spec = copy.deepcopy(SPEC)
    spec["prefill"]["targetQueuedPromptTokens"] = 8192
    spec["decode"]["targetRunningRequests"] = 64
    spec["ratio"] = {"minPrefillPerDecode": 0.25}
    spec["maxMetricAgeSeconds"] = 20
    policy = policy_from_spec(spec)
    assert policy.pool("prefill").target_queued_tokens == 8192.0
    assert policy.pool("decode").target_running_requests == 64.0
    assert policy.ratio == RatioBounds(min_prefill_per_decode=0.25, max_prefill_per_decode=None)
    assert policy.max_metric_age_s == 20.0


def _without(path: tuple[str, ...]) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    node = spec
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return spec


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    node = spec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return spec


@pytest.mark.parametrize(
    ("spec", "mode", "message"),
    [
        (
            _without(("prefill", "targetQueueDepth")),
            "disaggregated",
            "spec.autoscaling.prefill.targetQueueDepth: required",
        ),
        (_without(("decode",)), "disaggregated", "spec.autoscaling.decode: must be an object"),
        (
            _with(("scaleUp", "maxStep"), "2"),
            "disaggregated",
            "spec.autoscaling.scaleUp.maxStep: must be an integer, got '2'",
        ),
        (
            _with(("decode", "targetKVUsage"), True),
            "disaggregated",
            "spec.autoscaling.decode.targetKVUsage: must be a number, got True",
        ),
        (_without(("intervalSeconds",)), "disaggregated", "spec.autoscaling.intervalSeconds: required"),
        (SPEC, "both", "spec.mode: must be disaggregated or aggregated, got 'both'"),
        (
            _with(("prefill", "maxReplicas"), 0),
            "disaggregated",
            "PoolPolicy(prefill).max_replicas: 0 is below min_replicas 1",
        ),
    ],
)
def test_bad_spec_names_the_field(spec: dict[str, Any], mode: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        policy_from_spec(spec, mode)
    assert str(info.value) == message
