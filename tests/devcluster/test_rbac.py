"""RBAC: the restricted user is refused what no binding grants; a pod on a process node whose
service account has a Role can list Pods and cannot list Secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_dev.kubeapi import ApiError
from baton_dev.testing import DevCluster
from baton_support.wait import wait_for
from tests.devcluster.pods import run_to_completion

pytestmark = pytest.mark.k8s
DATA = Path(__file__).parent / "data"


def _allowed(dev_cluster: DevCluster, ns: str, user: str, verb: str, resource: str) -> bool:
    """What the API server's authorizer answers now for `user` (a SubjectAccessReview)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {"user": user, "resourceAttributes": {"namespace": ns, "verb": verb, "resource": resource}},
    }
    answer = dev_cluster.admin.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer["status"].get("allowed"))


def _pod_reader_role(dev_cluster: DevCluster, ns: str, subject: dict[str, str]) -> None:
    """A Role reading pods bound to `subject`; returns once the authorizer applies the binding
    (its RBAC cache follows the API by a watch: a request right after the create may be refused)."""
    api = dev_cluster.admin
    api.post(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
    )
    api.post(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        {
            "metadata": {"name": "pod-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [subject],
        },
    )
    user = subject["name"]
    if subject["kind"] == "ServiceAccount":
        user = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    wait_for(
        lambda: _allowed(dev_cluster, ns, user, "list", "pods"),
        timeout=60,
        interval=0.1,
        message=f"the RoleBinding to let {user} list pods in {ns}",
    )


def test_restricted_user_is_refused_without_a_binding(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    with pytest.raises(ApiError) as refused:
        dev_cluster.restricted.get(f"/api/v1/namespaces/{k8s_namespace}/pods")
    assert refused.value.status == 403
    assert refused.value.message == (
        f'pods is forbidden: User "restricted" cannot list resource "pods" in API group "" '
        f'in the namespace "{k8s_namespace}"'
    )
    result = dev_cluster.kubectl("get", "secrets", "-n", k8s_namespace, restricted=True, check=False)
    assert result.returncode == 1
    assert 'User "restricted" cannot list resource "secrets"' in result.stderr


def test_restricted_user_gets_exactly_what_its_role_grants(
    dev_cluster: DevCluster, k8s_namespace: str
) -> None:
    _pod_reader_role(
        dev_cluster,
        k8s_namespace,
        {"kind": "User", "name": "restricted", "apiGroup": "rbac.authorization.k8s.io"},
    )
    assert dev_cluster.restricted.get(f"/api/v1/namespaces/{k8s_namespace}/pods")["items"] == []
    with pytest.raises(ApiError) as refused:
        dev_cluster.restricted.get(f"/api/v1/namespaces/{k8s_namespace}/secrets")
    assert refused.value.status == 403
    with pytest.raises(ApiError) as refused_elsewhere:
        dev_cluster.restricted.get("/api/v1/namespaces/default/pods")
    assert refused_elsewhere.value.status == 403


def test_pod_service_account_token_carries_its_role(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "reader"}})
    _pod_reader_role(dev_cluster, ns, {"kind": "ServiceAccount", "name": "reader", "namespace": ns})
    check = {
        "name": "check",
        "image": "python:3.11",
        "command": ["python", str(DATA / "rbac_check.py")],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    }
    pod = run_to_completion(dev_cluster, ns, "rbac-check", [check], timeout_s=60, serviceAccountName="reader")
    log = dev_cluster.pod_log(ns, "rbac-check", "check")
    assert pod["status"]["phase"] == "Succeeded", log
    assert log.splitlines() == ["pods: allowed, 1 listed", "secrets: status 403"]
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
