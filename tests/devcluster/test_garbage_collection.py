"""Owner-reference garbage collection (KCM's garbage collector) deletes children."""

from __future__ import annotations

import json

import pytest

from baton_dev.spec import KWOK_TOLERATION
from baton_dev.testing import DevCluster
from baton_support.wait import wait_for

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
        lambda: (
            not dev_cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/child-a")
            and not dev_cluster.exists(f"/api/v1/namespaces/{ns}/secrets/child-b")
        ),
        timeout=30,
        interval=0.1,
        message="the garbage collector to delete both children",
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
        json.dumps(
            {
                "spec": {
                    "template": {"spec": {"nodeSelector": {"type": "kwok"}, "tolerations": [KWOK_TOLERATION]}}
                }
            }
        ),
    )
    wait_for(lambda: len(dev_cluster.pods(ns, "app=web")) == 2, timeout=60, interval=0.1, message="2 pods")
    dev_cluster.kubectl("delete", "deployment", "web", "-n", ns, "--cascade=foreground", "--wait=true")
    wait_for(lambda: dev_cluster.pods(ns, "app=web") == [], timeout=60, interval=0.1, message="pods gone")
    assert dev_cluster.admin.get(f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"] == []
