"""Engine Pods (API-server JSON) -> scrape targets and pending pods."""

from __future__ import annotations

from typing import Any

from baton_operator.autoscaler.metrics import ScrapeTarget
from baton_operator.autoscaler.pods import view_pods
from baton_operator.autoscaler.policy_types import PendingPod

GPU_MESSAGE = "0/3 nodes are available: 3 Insufficient amd.com/gpu."


def pod(
    name: str,
    role: str | None = "prefill",
    *,
    phase: str = "Running",
    ip: str | None = "127.0.0.21",
    ready: bool = True,
    deleting: bool = False,
    port: int | None = 8001,
    conditions: list[dict[str, Any]] | None = None,
    container_statuses: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    labels = {"baton.dev/deployment": "demo", "app.kubernetes.io/name": "baton"}
    if role is not None:
        labels["baton.dev/role"] = role
    metadata: dict[str, Any] = {"name": name, "namespace": "default", "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T02:00:00Z"
    ports = [{"name": "kv-transfer", "containerPort": 5600}]
    if port is not None:
        ports.append({"name": "http", "containerPort": port, "protocol": "TCP"})
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    status["conditions"] = (
        conditions
        if conditions is not None
        else [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
    )
    if container_statuses is not None:
        status["containerStatuses"] = container_statuses
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "engine", "image": "baton-engine", "ports": ports}]},
        "status": status,
    }


def test_running_pods_become_targets_with_readiness_and_named_port() -> None:
    view = view_pods(
        [
            pod("p-a", ip="127.0.0.21"),
            pod("p-b", ip="127.0.0.22", ready=False),
            pod("d-a", "decode", ip="127.0.0.23", deleting=True),
            pod("e-a", "engine", ip="127.0.0.24", port=None),
        ]
    )
    assert view.targets == (
        ScrapeTarget("p-a", "prefill", "http://127.0.0.21:8001/metrics", True),
        ScrapeTarget("p-b", "prefill", "http://127.0.0.22:8001/metrics", False),
        ScrapeTarget("d-a", "decode", "http://127.0.0.23:8001/metrics", False),
        ScrapeTarget("e-a", "engine", "http://127.0.0.24:8000/metrics", True),
    )
    assert view.pending == ()


def test_pending_pods_carry_their_reason() -> None:
    unschedulable = pod(
        "p-gpu",
        phase="Pending",
        ip=None,
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": GPU_MESSAGE}
        ],
    )
    creating = pod(
        "d-new",
        "decode",
        phase="Pending",
        ip=None,
        conditions=[{"type": "PodScheduled", "status": "True"}],
        container_statuses=[{"name": "engine", "state": {"waiting": {"reason": "ContainerCreating"}}}],
    )
    fresh = pod("d-fresh", "decode", phase="Pending", ip=None, conditions=[])
    view = view_pods([unschedulable, creating, fresh])
    assert view.targets == ()
    assert view.pending == (
        PendingPod("p-gpu", "prefill", f"Unschedulable: {GPU_MESSAGE}", True),
        PendingPod("d-new", "decode", "ContainerCreating", False),
        PendingPod("d-fresh", "decode", "Pending", False),
    )


def test_finished_unlabelled_and_ip_less_pods_are_left_out() -> None:
    view = view_pods(
        [
            pod("done", phase="Succeeded"),
            pod("failed", phase="Failed"),
            pod("router-x", "router"),
            pod("nolabel", None),
            pod("no-ip", ip=None),
        ]
    )
    assert view == view_pods([])
