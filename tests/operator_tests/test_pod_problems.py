"""Why a pool is stuck, from its pods (pure): each kind of problem, which one names the
conditions, the exact messages, and the pod view the operator caches."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from baton_operator.object_cache import PodIndex, pod_view
from baton_operator.pod_problems import (
    CONFIG_ERROR,
    CRASH_LOOP,
    IMAGE_PULL,
    NEVER_READY,
    UNSCHEDULABLE,
    Problem,
    Stuck,
    pod_problem,
    pool_problems,
    summary,
)
from baton_operator.resource_status import Observed, compute_status

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
SCHEDULER = "0/3 nodes are available: 3 Insufficient amd.com/gpu. preemption: 0/3 nodes are available."


def pod(name: str = "demo-decode-7c9-abcde", role: str = "decode", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "5",
            "labels": {"baton.dev/deployment": "demo", "baton.dev/role": role, "app": "x"},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"containers": [{"name": "engine"}]},
        "status": status,
    }


UNSCHEDULED = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": SCHEDULER,
            "lastTransitionTime": "2026-01-01T11:00:00Z",
        }
    ],
}


def waiting(reason: str, message: str = "", restarts: int = 0, **extra: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
    container = {"name": "engine", "ready": False, "started": False, "restartCount": restarts, "state": state}
    return {"phase": "Pending", "containerStatuses": [{**container, **extra}]}


def running(started_at: str, ready: bool, started: bool = True) -> dict[str, Any]:
    container = {
        "name": "engine",
        "ready": ready,
        "started": started,
        "restartCount": 0,
        "state": {"running": {"startedAt": started_at}},
    }
    return {"phase": "Running", "containerStatuses": [container]}


CRASHED = {"terminated": {"exitCode": 2, "reason": "Error", "finishedAt": "2026-01-01T11:59:00Z"}}


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        (
            UNSCHEDULED,
            Problem(UNSCHEDULABLE, "decode", "demo-decode-7c9-abcde", f"is unschedulable: {SCHEDULER}"),
        ),
        (
            waiting("ImagePullBackOff", 'Back-off pulling image "ghcr.io/x/engine:9"'),
            Problem(
                IMAGE_PULL,
                "decode",
                "demo-decode-7c9-abcde",
                'container engine: ImagePullBackOff: Back-off pulling image "ghcr.io/x/engine:9"',
            ),
        ),
        (
            waiting("ErrImagePull"),
            Problem(IMAGE_PULL, "decode", "demo-decode-7c9-abcde", "container engine: ErrImagePull"),
        ),
        (
            waiting("CrashLoopBackOff", "back-off 40s restarting failed container", 4, lastState=CRASHED),
            Problem(
                CRASH_LOOP,
                "decode",
                "demo-decode-7c9-abcde",
                "container engine: CrashLoopBackOff (restarted 4 times, last exit 2 Error): "
                "back-off 40s restarting failed container",
            ),
        ),
        (
            waiting("CreateContainerConfigError", 'secret "hf" not found'),
            Problem(
                CONFIG_ERROR,
                "decode",
                "demo-decode-7c9-abcde",
                'container engine: CreateContainerConfigError: secret "hf" not found',
            ),
        ),
        (
            running("2026-01-01T11:57:59Z", ready=False),
            Problem(
                NEVER_READY,
                "decode",
                "demo-decode-7c9-abcde",
                "container engine: running since 2026-01-01T11:57:59Z, not Ready 120 s later (its readiness "
                "probe fails)",
            ),
        ),
        (running("2026-01-01T11:58:01Z", ready=False), None),  # 119 s: still within the grace
        (running("2026-01-01T11:00:00Z", ready=False, started=False), None),  # still loading (startup probe)
        (running("2026-01-01T11:00:00Z", ready=True), None),
        (waiting("ContainerCreating"), None),
        ({"phase": "Pending"}, None),
    ],
)
def test_a_pods_problem(status: dict[str, Any], problem: Problem | None) -> None:
    assert pod_problem(pod(**status), "decode", NOW) == problem


def test_a_pod_being_deleted_has_no_problem() -> None:
    deleting = pod(**waiting("CrashLoopBackOff"))
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"
    assert pod_problem(deleting, "decode", NOW) is None


def test_an_init_containers_image_pull_counts() -> None:
    status = {
        "phase": "Pending",
        "initContainerStatuses": [
            {"name": "model-download", "ready": False, "state": {"waiting": {"reason": "ImagePullBackOff"}}}
        ],
    }
    assert pod_problem(pod(**status), "prefill", NOW) == Problem(
        IMAGE_PULL, "prefill", "demo-decode-7c9-abcde", "container model-download: ImagePullBackOff"
    )


def test_the_most_telling_problem_names_the_condition_and_every_one_is_listed() -> None:
    pools = {
        "prefill": [pod("demo-prefill-b", "prefill", **waiting("CrashLoopBackOff", restarts=1))],
        "decode": [
            pod("demo-decode-a", **UNSCHEDULED),
            pod("demo-decode-b", **running("2026-01-01T11:59:00Z", True)),
        ],
        "router": [],
    }
    problems = pool_problems(pools, NOW)
    assert [(p.kind, p.pod) for p in problems] == [
        (UNSCHEDULABLE, "demo-decode-a"),
        (CRASH_LOOP, "demo-prefill-b"),
    ]
    assert summary(problems) == Stuck(
        UNSCHEDULABLE,
        f"decode: pod demo-decode-a is unschedulable: {SCHEDULER}; "
        "prefill: pod demo-prefill-b container engine: CrashLoopBackOff (restarted 1 times)",
    )
    assert summary([]) is None


def deployment(name: str, desired: int = 1, ready: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "generation": 1},
        "spec": {"replicas": desired},
        "status": {
            "replicas": desired,
            "readyReplicas": ready,
            "updatedReplicas": desired,
            "observedGeneration": 1,
        },
    }


def conditions(
    pods: dict[str, list[dict[str, Any]]], decode_ready: int = 0
) -> dict[str, tuple[str, str, str]]:
    status = compute_status(
        name="demo",
        generation=1,
        observed=Observed(
            deployments={
                "prefill": deployment("demo-prefill", ready=1),
                "decode": deployment("demo-decode", ready=decode_ready),
                "router": deployment("demo-router", ready=1),
            },
            pods=pods,
        ),
        endpoint="http://demo-router.ns.svc:80",
        now="2026-01-01T12:00:00Z",
        previous={},
    )
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_a_stuck_pool_says_why_in_ready_and_degraded() -> None:
    stuck = f"decode: pod demo-decode-a is unschedulable: {SCHEDULER}"
    assert conditions({"decode": [pod("demo-decode-a", **UNSCHEDULED)]}) == {
        "Ready": ("False", UNSCHEDULABLE, stuck),
        "Progressing": ("True", "RollingOut", "updating decode"),
        "Degraded": ("True", UNSCHEDULABLE, stuck),
    }
    # Without pod problems: the counts, and no failure.
    assert conditions({"decode": [pod("demo-decode-a", **waiting("ContainerCreating"))]}) == {
        "Ready": ("False", "PodsNotReady", "prefill 1/1, decode 0/1, router 1/1"),
        "Progressing": ("True", "RollingOut", "updating decode"),
        "Degraded": ("False", "AsExpected", "no failures observed"),
    }
    # Every pool Ready, but a surge pod cannot be placed: Ready, and Degraded says so.
    ready = conditions({"decode": [pod("demo-decode-a", **UNSCHEDULED)]}, decode_ready=1)
    assert ready["Ready"][:2] == ("True", "AllPodsReady")
    assert ready["Degraded"] == ("True", UNSCHEDULABLE, stuck)


def test_the_pod_view_keeps_what_problems_read_and_the_index_groups_by_pool() -> None:
    crash = pod("demo-decode-a", **waiting("CrashLoopBackOff", "back-off", 3, lastState=CRASHED))
    view = pod_view(crash)
    assert view == {
        "metadata": {
            "name": "demo-decode-a",
            "namespace": "ns",
            "uid": "uid-demo-decode-a",
            "resourceVersion": "5",
            "labels": {"baton.dev/deployment": "demo", "baton.dev/role": "decode", "app": "x"},
        },
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "started": False,
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
                }
            ],
        },
    }
    assert pod_problem(view, "decode", NOW) == pod_problem(crash, "decode", NOW)
    index = PodIndex()
    assert index.observe(crash) is True
    assert index.observe(pod("demo-router-x", "router", phase="Running")) is True
    assert index.observe({"metadata": {"name": "stray", "namespace": "ns", "labels": {}}}) is False
    assert {role: [p["metadata"]["name"] for p in pods] for role, pods in index.of("ns", "demo").items()} == {
        "decode": ["demo-decode-a"],
        "router": ["demo-router-x"],
    }
    index.forget(crash)
    assert list(index.of("ns", "demo")) == ["router"]
    assert index.of("other", "demo") == {}
