"""Deployment → ReplicaSet → Pods on fake GPU (kwok) nodes, honouring amd.com/gpu limits; a pod
asking for more GPUs than any node has stays Pending with the scheduler's reason."""

from __future__ import annotations

from collections import Counter

import pytest

from baton_dev.spec import KWOK_TOLERATION
from baton_dev.testing import DevCluster, condition, is_ready
from baton_support.wait import wait_for

pytestmark = pytest.mark.k8s


def _deployment(name: str, replicas: int, gpus: int) -> dict[str, object]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"type": "kwok"},
                    "tolerations": [KWOK_TOLERATION],
                    "containers": [
                        {
                            "name": "engine",
                            "image": "example.invalid/engine:1",
                            "resources": {"limits": {"amd.com/gpu": str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def test_deployment_pods_fill_gpu_nodes(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    # 2 kwok nodes x 8 GPUs; 5 pods x 3 GPUs: at most 2 fit per node, so exactly 4 run.
    dev_cluster.apply(_deployment("gpu-app", replicas=5, gpus=3), k8s_namespace)

    def settled() -> list[dict[str, object]] | None:
        pods = dev_cluster.pods(k8s_namespace, "app=gpu-app")
        running = [p for p in pods if is_ready(p)]
        pending = [p for p in pods if (condition(p, "PodScheduled") or {}).get("reason") == "Unschedulable"]
        return pods if len(pods) == 5 and len(running) == 4 and len(pending) == 1 else None

    pods = wait_for(settled, timeout=60, interval=0.1, message="4 pods running and 1 unschedulable")
    per_node = Counter(p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName"))
    assert per_node == {"kwok-node-0": 2, "kwok-node-1": 2}
    pending = next(p for p in pods if not p["spec"].get("nodeName"))
    assert "Insufficient amd.com/gpu" in condition(pending, "PodScheduled")["message"]  # type: ignore[index]

    # The chain of owners: Deployment → ReplicaSet → Pods.
    deployment = dev_cluster.admin.get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/gpu-app")
    replicasets = dev_cluster.admin.get(f"/apis/apps/v1/namespaces/{k8s_namespace}/replicasets")["items"]
    assert len(replicasets) == 1
    rs = replicasets[0]
    assert rs["metadata"]["ownerReferences"][0]["uid"] == deployment["metadata"]["uid"]
    for pod in pods:
        assert pod["metadata"]["ownerReferences"][0]["uid"] == rs["metadata"]["uid"]
        assert pod["spec"]["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "3"
    for pod in pods:
        if pod["spec"].get("nodeName"):
            assert pod["status"]["podIP"].startswith("127.1.")


def test_pod_wanting_more_gpus_than_any_node_stays_pending(
    dev_cluster: DevCluster, k8s_namespace: str
) -> None:
    dev_cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "too-big"},
            "spec": {
                "tolerations": [KWOK_TOLERATION],  # every node is a candidate: none has 9 GPUs
                "containers": [
                    {
                        "name": "c",
                        "image": "example.invalid/x:1",
                        "resources": {"limits": {"amd.com/gpu": "9"}},
                    }
                ],
            },
        },
        k8s_namespace,
    )

    def unschedulable() -> dict[str, object] | None:
        scheduled = condition(dev_cluster.pod(k8s_namespace, "too-big"), "PodScheduled")
        return scheduled if scheduled and scheduled.get("reason") == "Unschedulable" else None

    scheduled = wait_for(unschedulable, timeout=30, interval=0.1, message="the scheduler's verdict")
    assert scheduled["status"] == "False"
    assert scheduled["message"] == (
        "0/3 nodes are available: 3 Insufficient amd.com/gpu. no new claims to deallocate, "
        "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
    )
    pod = dev_cluster.pod(k8s_namespace, "too-big")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]
