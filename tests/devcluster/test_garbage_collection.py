"""Owner-reference garbage collection (KCM's garbage collector) deletes children."""

from __future__ import annotations

import pytest

from baton_dev.testing import DevCluster, wait_for

pytestmark = pytest.mark.k8s


def test_children_are_deleted_with_their_owner(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    api, ns = dev_cluster.admin, k8s_namespace
    owner = api.post(
        f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "owner"}, "data": {"k": "v"}}
    )
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    api.post(
        f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "child-a", "ownerReferences": [ref]}}
    )
    api.post(f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": "child-b", "ownerReferences": [ref]}})
    api.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "unowned"}})

    api.delete(f"/api/v1/namespaces/{ns}/configmaps/owner", {"propagationPolicy": "Background"})

    wait_for(
        "the garbage collector to delete both children",
        lambda: (
            not dev_cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/child-a")
            and not dev_cluster.exists(f"/api/v1/namespaces/{ns}/secrets/child-b")
        ),
    )
    assert dev_cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/unowned")


def test_foreground_deletion_of_a_deployment_removes_replicasets_and_pods(
    dev_cluster: DevCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    dev_cluster.kubectl(
        "create", "deployment", "web", "--image=example.invalid/web:1", "--replicas=2", "-n", ns
    )
    dev_cluster.kubectl(
        "patch",
        "deployment",
        "web",
        "-n",
        ns,
        "-p",
        '{"spec":{"template":{"spec":{"nodeSelector":{"type":"kwok"}}}}}',
    )
    wait_for("2 pods", lambda: len(dev_cluster.pods(ns, "app=web")) == 2, timeout_s=60)
    dev_cluster.kubectl("delete", "deployment", "web", "-n", ns, "--cascade=foreground", "--wait=true")
    wait_for("pods gone", lambda: dev_cluster.pods(ns, "app=web") == [], timeout_s=60)
    assert dev_cluster.admin.get(f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"] == []
