"""`helm install` / `helm uninstall` of a small chart against the local cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton_dev.testing import DevCluster
from baton_support.wait import wait_for

pytestmark = pytest.mark.k8s
CHART = Path(__file__).parent / "data" / "chart"


def test_helm_install_and_uninstall(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    version = dev_cluster.helm("version", "--short").stdout
    assert version.startswith("v3.21.4")
    dev_cluster.helm(
        "install", "demo", str(CHART), "-n", ns, "--set", "greeting=hi", "--wait", "--timeout", "60s"
    )

    settings = dev_cluster.admin.get(f"/api/v1/namespaces/{ns}/configmaps/demo-settings")
    assert settings["data"] == {"greeting": "hi", "kubeVersion": "v1.36.3"}

    def ready_replicas() -> int | None:
        deployment = dev_cluster.admin.get(f"/apis/apps/v1/namespaces/{ns}/deployments/demo-worker")
        return deployment["status"].get("readyReplicas")

    # helm's --wait may judge readiness from the ReplicaSet, which the Deployment's status follows
    # a moment later.
    wait_for(
        lambda: ready_replicas() == 2,
        timeout=30,
        interval=0.1,
        message="demo-worker's status to count 2 ready replicas",
    )
    releases = json.loads(dev_cluster.helm("list", "-n", ns, "-o", "json").stdout)
    assert [(r["name"], r["status"], r["chart"]) for r in releases] == [("demo", "deployed", "tiny-0.1.0")]

    dev_cluster.helm("uninstall", "demo", "-n", ns, "--wait", "--timeout", "60s")
    assert not dev_cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/demo-settings")
    assert not dev_cluster.exists(f"/apis/apps/v1/namespaces/{ns}/deployments/demo-worker")
    wait_for(
        lambda: dev_cluster.pods(ns, "app.kubernetes.io/instance=demo") == [],
        timeout=30,
        interval=0.1,
        message="the chart's pods to go",
    )
    assert json.loads(dev_cluster.helm("list", "-n", ns, "-o", "json").stdout) == []
