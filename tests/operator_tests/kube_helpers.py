"""Helpers for tests that talk to a real API server: async and sync clients, namespaces, objects."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kopf
import pytest

from baton_operator import metrics, models
from baton_operator.kube import Kube
from baton_support.apiserver import ApiServer, Rest, api_server, binary_dir
from baton_support.operator_process import established
from baton_support.wait import wait_for

#: Every kind the operator writes as a resource's child: (apiVersion, kind).
CHILD_KINDS = [
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("apps/v1", "Deployment"),
    ("v1", "Secret"),
]


@contextmanager
def api_server_or_skip(workdir: Path, controllers: tuple[str, ...] = ()) -> Iterator[ApiServer]:
    """`baton_support.apiserver.api_server`, or the test skipped where the binaries are not built."""
    bin_dir = binary_dir()
    if bin_dir is None:
        pytest.skip("etcd/kube-apiserver not built yet (bash devcluster/scripts/build.sh)")
    with api_server(workdir, bin_dir, controllers) as server:
        yield server


def async_kube(server: ApiServer, token: str | None = None) -> Kube:
    info = kopf.ConnectionInfo(server=server.url, ca_path=str(server.ca_file), token=token or server.token)
    return Kube(lambda: info, on_request=metrics.count_api_request)


def create_namespace(kube: Any, name: str, labels: dict[str, str] | None = None) -> None:
    import kubernetes

    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    kubernetes.client.CoreV1Api(kube).create_namespace(body)


def create_infd(kube: Any, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    import kubernetes

    body = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": name}, "spec": spec}
    api = kubernetes.client.CustomObjectsApi(kube)
    created: dict[str, Any] = api.create_namespaced_custom_object(
        models.GROUP, models.VERSION, namespace, models.PLURAL, body
    )
    return created


def get_infd(kube: Any, namespace: str, name: str) -> dict[str, Any]:
    import kubernetes

    api = kubernetes.client.CustomObjectsApi(kube)
    got: dict[str, Any] = api.get_namespaced_custom_object(
        models.GROUP, models.VERSION, namespace, models.PLURAL, name
    )
    return got


def create_foreign_deployment(rest: Rest, namespace: str, name: str) -> None:
    """A Deployment someone else created under a name Baton wants, with another selector: the
    selector is immutable, so Baton's apply of that Deployment is refused (422)."""
    labels = {"app": "someone-else"}
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments?fieldManager=someone-else"
    status, answer = rest.call("POST", path, body)
    assert status == 201, answer


def dev_cluster_kube(cluster: Any) -> Kube:
    """The operator's own client of a `baton_dev` cluster (a DevCluster), with admin credentials."""
    from baton_dev.kubeapi import ApiAccess

    access = ApiAccess.from_kubeconfig(cluster.state.admin_kubeconfig)
    info = kopf.ConnectionInfo(server=access.server, ca_path=str(access.ca_file), token=access.token)
    return Kube(lambda: info)


def install_crd_in(cluster: Any, crd: dict[str, Any]) -> None:
    """Create a CRD in a `baton_dev` cluster unless it is there, and wait until it is Established."""
    from baton_dev.kubeapi import ApiError

    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    try:
        cluster.admin.post(crds, crd)
    except ApiError as exc:
        if exc.status != 409:
            raise
    path = f"{crds}/{crd['metadata']['name']}"
    wait_for(
        lambda: established(cluster.admin.get(path)),
        timeout=30,
        interval=0.1,
        message=f"the CRD {crd['metadata']['name']} to be Established",
    )
