"""Engine Pods (API-server JSON) -> scrape targets and pending pods."""

from __future__ import annotations

from baton_operator.autoscaler.metrics import ScrapeTarget
from baton_operator.autoscaler.pods import view_pods
from baton_operator.autoscaler.policy_types import PendingPod

from .pod_json import GPU_MESSAGE, pod


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
