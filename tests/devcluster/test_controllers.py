"""Controller-manager controllers that run under their own service-account credentials
(--use-service-account-credentials): service-account tokens and the root CA publisher."""

from __future__ import annotations

import base64

import pytest

from baton_dev.testing import DevCluster
from baton_support.wait import wait_for

pytestmark = pytest.mark.k8s


def test_service_account_token_secret_is_populated(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    api, ns = dev_cluster.admin, k8s_namespace
    api.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "bot"}})
    api.post(
        f"/api/v1/namespaces/{ns}/secrets",
        {
            "metadata": {"name": "bot-token", "annotations": {"kubernetes.io/service-account.name": "bot"}},
            "type": "kubernetes.io/service-account-token",
        },
    )

    def token() -> str | None:
        data = api.get(f"/api/v1/namespaces/{ns}/secrets/bot-token").get("data") or {}
        return base64.b64decode(data["token"]).decode() if "token" in data else None

    review = api.post(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        {"spec": {"token": wait_for(token, timeout=30, interval=0.1, message="token")}},
    )
    assert review["status"]["authenticated"] is True
    assert review["status"]["user"]["username"] == f"system:serviceaccount:{ns}:bot"


def test_controllers_act_as_their_own_service_accounts(dev_cluster: DevCluster) -> None:
    wanted = {"replicaset-controller", "deployment-controller", "generic-garbage-collector"}

    def names() -> set[str]:
        accounts = dev_cluster.admin.get("/api/v1/namespaces/kube-system/serviceaccounts")["items"]
        return {a["metadata"]["name"] for a in accounts}

    # The controller manager creates each controller's account as it starts that controller,
    # possibly after the cluster reported ready (which waits for the default account only).
    wait_for(lambda: wanted <= names(), timeout=30, interval=0.1, message="the controllers' service accounts")


def test_root_ca_is_published_to_new_namespaces(dev_cluster: DevCluster, k8s_namespace: str) -> None:
    cm = wait_for(
        lambda: (
            dev_cluster.exists(f"/api/v1/namespaces/{k8s_namespace}/configmaps/kube-root-ca.crt")
            and dev_cluster.admin.get(f"/api/v1/namespaces/{k8s_namespace}/configmaps/kube-root-ca.crt")
        ),
        timeout=30,
        interval=0.1,
        message="kube-root-ca.crt",
    )
    assert cm["data"]["ca.crt"] == dev_cluster.state.ca_file.read_text()
