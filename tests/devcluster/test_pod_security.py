"""PodSecurity admission: a namespace labelled enforce=restricted rejects a privileged pod."""

from __future__ import annotations

import pytest

from baton_dev.kubeapi import ApiError
from baton_dev.spec import KWOK_TOLERATION
from baton_dev.testing import DevCluster

pytestmark = pytest.mark.k8s


def _pod(name: str, security: dict[str, object], pod_security: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "tolerations": [KWOK_TOLERATION],
            "securityContext": pod_security,
            "containers": [{"name": "c", "image": "example.invalid/x:1", "securityContext": security}],
        },
    }


def test_restricted_namespace_rejects_privileged_pod(dev_cluster: DevCluster) -> None:
    with dev_cluster.namespace("psa", labels={"pod-security.kubernetes.io/enforce": "restricted"}) as ns:
        with pytest.raises(ApiError) as rejected:
            dev_cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", _pod("priv", {"privileged": True}, {}))
        assert rejected.value.status == 403
        assert rejected.value.message.startswith(
            'pods "priv" is forbidden: violates PodSecurity "restricted:latest": privileged '
            '(container "c" must not set securityContext.privileged=true)'
        )

        # A pod meeting the restricted profile is admitted: the rejection is about the profile.
        compliant = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        }
        created = dev_cluster.admin.post(
            f"/api/v1/namespaces/{ns}/pods",
            _pod("ok", compliant, {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}),
        )
        assert created["metadata"]["name"] == "ok"


def test_unlabelled_namespace_admits_privileged_pod(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    created = dev_cluster.admin.post(
        f"/api/v1/namespaces/{k8s_namespace}/pods", _pod("priv", {"privileged": True}, {})
    )
    assert created["spec"]["containers"][0]["securityContext"] == {"privileged": True}
