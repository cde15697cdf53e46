"""Run-to-completion pods (restartPolicy Never) on a process node, for the devcluster tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baton_dev.testing import DevCluster
from baton_support.wait import wait_for


def run_to_completion(
    dev_cluster: DevCluster,
    ns: str,
    name: str,
    containers: Sequence[dict[str, Any]],
    *,
    init_containers: Sequence[dict[str, Any]] = (),
    timeout_s: float = 30,
    **spec: Any,
) -> dict[str, Any]:
    """Create pod `name` on a process node, never restarted (`spec`: further PodSpec fields);
    the pod once it has Succeeded or Failed."""
    pod_spec: dict[str, Any] = {"nodeSelector": {"type": "process"}, "restartPolicy": "Never", **spec}
    if init_containers:
        pod_spec["initContainers"] = list(init_containers)
    pod_spec["containers"] = list(containers)
    dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", {"metadata": {"name": name}, "spec": pod_spec})

    def done() -> dict[str, Any] | None:
        pod = dev_cluster.pod(ns, name)
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    return wait_for(done, timeout=timeout_s, interval=0.1, message=f"{name} to finish")
