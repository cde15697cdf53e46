"""Pure status computation: counts, conditions, transition times, the merge patch."""

from __future__ import annotations

from typing import Any

import pytest

from baton_operator.resource_status import (
    Failure,
    Observed,
    compute_status,
    role_status,
    status_changed,
    stored_failure,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(
    name: str, desired: int = 1, ready: int = 0, replicas: int | None = None, updated: int | None = None,
    generation: int = 1, observed: int = 1, conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": desired},
        "status": {
            "replicas": desired if replicas is None else replicas,
            "readyReplicas": ready,
            "updatedReplicas": desired if updated is None else updated,
            "observedGeneration": observed,
            "conditions": conditions or [],
        },
    }


def status_of(deployments: dict[str, Any], error: str | None = None, previous: Any = None) -> dict[str, Any]:
    failure = None if error is None else Failure("ReconcileFailed", error)
    return compute_status(
        name="demo",
        generation=3,
        observed=Observed(deployments=deployments, failure=failure),
        endpoint="http://demo-router.ns.svc:80",
        now=T1,
        previous=previous or {},
    )


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_role_status_counts() -> None:
    got = role_status(deployment("demo-decode", desired=3, ready=2, replicas=3), {"baton.dev/role": "decode"})
    assert got.model_dump(by_alias=True, exclude_none=True) == {
        "replicas": 3,
        "readyReplicas": 2,
        "desiredReplicas": 3,
        "ready": "2/3",
        "selector": "baton.dev/role=decode",
        "tensorParallelSize": 1,
    }
    assert role_status(None, {"a": "b"}).ready == "0/0"


def test_role_status_shows_the_pools_tensor_parallel_size() -> None:
    from baton_operator.builders import BuildContext, Owner, desired_children
    from baton_operator.models import InferenceDeploymentSpec

    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": "builtin:smollm2-135m-instruct"},
            "prefill": {"resources": {"gpus": 4}},
        }
    )
    children = desired_children(
        BuildContext(owner=Owner(name="demo", namespace="ns", uid="u"), spec=spec), "k" * 64
    )
    built = {m["metadata"]["name"]: m for m in children.applied if m["kind"] == "Deployment"}
    sizes = {
        name: role_status(built[name], {}).tensor_parallel_size for name in ("demo-prefill", "demo-decode")
    }
    assert sizes == {"demo-prefill": 4, "demo-decode": 1}


ALL_READY = {
    "prefill": deployment("demo-prefill", ready=1),
    "decode": deployment("demo-decode", desired=2, ready=2),
    "router": deployment("demo-router", ready=1),
}


@pytest.mark.parametrize(
    ("deployments", "error", "expected"),
    [
        (
            ALL_READY,
            None,
            {
                "Ready": ("True", "AllPodsReady"),
                "Progressing": ("False", "Stable"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            {**ALL_READY, "decode": deployment("demo-decode", desired=2, ready=1)},
            None,
            {
                "Ready": ("False", "PodsNotReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            {**ALL_READY, "router": None},
            None,
            {
                "Ready": ("False", "Creating"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            {**ALL_READY, "prefill": deployment("demo-prefill", ready=1, generation=2, observed=1)},
            None,
            {
                "Ready": ("True", "AllPodsReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            {
                **ALL_READY,
                "decode": deployment(
                    "demo-decode",
                    desired=2,
                    ready=1,
                    conditions=[
                        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
                    ],
                ),
            },
            None,
            {
                "Ready": ("False", "PodsNotReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("True", "DeploymentFailing"),
            },
        ),
        (
            {**ALL_READY, "prefill": deployment("demo-prefill", desired=0, ready=0)},
            None,
            {
                "Ready": ("False", "PodsNotReady"),
                "Progressing": ("False", "Stable"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            ALL_READY,
            "KubeError: HTTP 403: forbidden",
            {
                "Ready": ("False", "ReconcileFailed"),
                "Progressing": ("False", "Stable"),
                "Degraded": ("True", "ReconcileFailed"),
            },
        ),
    ],
    ids=[
        "ready",
        "decode-not-ready",
        "router-missing",
        "rolling",
        "deadline-exceeded",
        "scaled-to-zero",
        "error",
    ],
)
def test_conditions(
    deployments: dict[str, Any], error: str | None, expected: dict[str, tuple[str, str]]
) -> None:
    assert conds(status_of(deployments, error)) == expected


def test_patch_shape_and_observed_generation() -> None:
    status = status_of(ALL_READY)
    assert status["observedGeneration"] == 3
    assert status["endpoint"] == "http://demo-router.ns.svc:80"
    assert status["pool"] is None  # not this mode: nulled in the merge patch
    assert status["decode"]["ready"] == "2/2"
    ready = status["conditions"][0]
    assert ready == {
        "type": "Ready",
        "status": "True",
        "observedGeneration": 3,
        "lastTransitionTime": T1,
        "reason": "AllPodsReady",
        "message": "prefill 1/1, decode 2/2, router 1/1",
    }
    assert "observedGeneration" not in status_of(ALL_READY, error="boom")


def test_transition_time_moves_only_on_a_flip() -> None:
    previous = {
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": T0, "reason": "AllPodsReady"},
            {"type": "Degraded", "status": "True", "lastTransitionTime": T0, "reason": "ReconcileFailed"},
        ]
    }
    status = status_of(ALL_READY, previous=previous)
    times = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert times == {"Ready": T0, "Progressing": T1, "Degraded": T1}


def test_a_child_refresh_leaves_observed_generation_as_stored() -> None:
    status = compute_status(
        name="demo",
        generation=3,
        observed=Observed(deployments=ALL_READY),
        endpoint="http://demo-router.ns.svc:80",
        now=T1,
        previous={},
        record_generation=False,
    )
    assert "observedGeneration" not in status
    assert [c["observedGeneration"] for c in status["conditions"]] == [3, 3, 3]


READY_T0 = {"type": "Ready", "status": "True", "lastTransitionTime": T0, "reason": "AllPodsReady"}


@pytest.mark.parametrize(
    ("stored", "patch", "changed"),
    [
        ({}, {}, False),
        ({"endpoint": "a"}, {"endpoint": "a"}, False),
        ({"endpoint": "a"}, {"endpoint": "b"}, True),
        ({}, {"endpoint": "a"}, True),
        ({}, {"pool": None}, False),  # deleting an absent key
        ({"pool": {"ready": "0/0"}}, {"pool": None}, True),
        ({"decode": {"ready": "1/1", "replicas": 1}}, {"decode": {"ready": "1/1"}}, False),  # merged
        ({"decode": {"ready": "1/1"}}, {"decode": {"ready": "0/1"}}, True),
        ({"decode": "x"}, {"decode": {"ready": "0/1"}}, True),
        ({"conditions": [READY_T0]}, {"conditions": [READY_T0]}, False),
        ({"conditions": [READY_T0]}, {"conditions": [{**READY_T0, "lastTransitionTime": T1}]}, True),
        ({"conditions": [READY_T0, READY_T0]}, {"conditions": [READY_T0]}, True),  # lists replace
        ({"observedGeneration": 2, "autoscaling": {"x": 1}}, {"observedGeneration": 2}, False),
    ],
)
def test_status_changed(stored: dict[str, Any], patch: dict[str, Any], changed: bool) -> None:
    assert status_changed(stored, patch) is changed


def test_an_unchanged_world_computes_an_unchanged_status() -> None:
    first = status_of(ALL_READY)
    stored = {**first, "autoscaling": {"lastDecision": {"decode": 2}}}
    later = compute_status(
        name="demo",
        generation=3,
        observed=Observed(deployments=ALL_READY),
        endpoint="http://demo-router.ns.svc:80",
        now="2026-01-01T01:00:00Z",  # later: transition times stay, so nothing to write
        previous=stored,
    )
    assert status_changed(stored, later) is False
    not_ready = {**ALL_READY, "router": deployment("demo-router", ready=0)}
    assert status_changed(stored, status_of(not_ready, previous=stored)) is True


@pytest.mark.parametrize(
    ("conditions", "failure"),
    [
        ([], None),
        ([{"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "ok"}], None),
        ([{"type": "Degraded", "status": "True", "reason": "DeploymentFailing", "message": "x"}], None),
        ([{"type": "Ready", "status": "False", "reason": "ReconcileFailed", "message": "HTTP 403"}], None),
        (
            [{"type": "Degraded", "status": "True", "reason": "ReconcileFailed", "message": "HTTP 403"}],
            Failure("ReconcileFailed", "HTTP 403"),
        ),
        (
            [
                {
                    "type": "Degraded",
                    "status": "True",
                    "reason": "ChildRefused",
                    "message": "Deployment x: ...",
                }
            ],
            Failure("ChildRefused", "Deployment x: ..."),
        ),
        (
            [{"type": "Degraded", "status": "True", "reason": "ReconcileFailed"}],
            Failure("ReconcileFailed", "reconcile failed"),
        ),
    ],
)
def test_stored_failure(conditions: list[dict[str, str]], failure: Failure | None) -> None:
    assert stored_failure({"conditions": conditions}) == failure
