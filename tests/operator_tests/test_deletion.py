"""Deleted InferenceDeployments stay deleted: `baton-operator run` (the chart's ServiceAccount) on
a real API server with the garbage collector and the Deployment and ReplicaSet controllers, so
that deleting a resource deletes its children and pods, as in a cluster.

- Deleted: once the garbage collector has removed the children, no child is created again and no
  Event is posted about the resource while the operator resyncs a live resource many times.
- Deleted and re-created under the same name (a new UID, as Argo CD's replace or an uninstall and
  reinstall do): no pod of the new resource is deleted while the operator resyncs many times,
  and every child is owned by the new UID only.

Both resources autoscale (builtin, deciding every second), so the autoscaler's periodic work is
covered as well as the resync's (every second here)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from baton_operator import models
from baton_operator.kube import collection_path
from baton_support.apiserver import ApiServer, Rest
from baton_support.operator_process import OperatorProcess, operator_process
from baton_support.wait import wait_for
from tests.operator_tests.cases import merged
from tests.operator_tests.kube_helpers import (
    CHILD_KINDS,
    api_server_or_skip,
    create_infd,
    create_namespace,
    get_infd,
)
from tests.operator_tests.watching import Watch, resource_version

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

RESYNC_S = 1
#: How many resyncs of a live resource the tests watch for: at least three, and longer than the
#: 10 s a failed periodic reconcile used to wait before its next try, so that leftover periodic
#: work of a deleted resource would have acted within the window whatever its state.
WINDOW_RESYNCS = 12
SPEC: dict[str, Any] = {
    "model": {"name": "smollm2", "source": "builtin:smollm2-135m-instruct"},
    "autoscaling": {"mode": "builtin", "intervalSeconds": 1},
}
CONTROLLERS = ("garbagecollector", "deployment", "replicaset")


@pytest.fixture(scope="module")
def own_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with api_server_or_skip(tmp_path_factory.mktemp("deletion-apiserver"), CONTROLLERS) as server:
        yield server


@pytest.fixture(scope="module")
def operator(own_apiserver: ApiServer, own_kube: Any, chart_installed: Any) -> Iterator[OperatorProcess]:
    kubeconfig, _ = chart_installed
    with operator_process(kubeconfig, own_apiserver.workdir, f"--resync-seconds={RESYNC_S}") as proc:
        yield proc


@pytest.fixture(scope="module")
def keeper(own_kube: Any, operator: OperatorProcess) -> str:
    """A live resource in its own namespace: its resyncs prove the operator's periodic work ran."""
    create_namespace(own_kube, "keeper")
    create_infd(own_kube, "keeper", "keeper", SPEC)
    wait_for(
        lambda: get_infd(own_kube, "keeper", "keeper").get("status", {}).get("observedGeneration") == 1,
        timeout=60,
        interval=0.1,
        message="the keeper reconciled",
    )
    return "keeper"


def resyncs(operator: OperatorProcess) -> float:
    """Successful periodic reconciles so far (only live resources succeed)."""
    found = re.search(
        r'baton_operator_reconciles_total\{result="ok",trigger="timer"\} (\S+)', operator.metrics()
    )
    return float(found.group(1)) if found else 0.0


def wait_for_resyncs(operator: OperatorProcess, count: int, live: int = 1) -> None:
    """Until each of the `live` live resources has been resynced `count` more times."""
    count *= live
    start = resyncs(operator)
    wait_for(
        lambda: resyncs(operator) >= start + count,
        timeout=90,
        interval=0.1,
        message=f"{count} more resyncs of the live resources",
    )


def children(rest: Rest, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object of everything labelled as `name`'s child."""
    found = {}
    for api_version, kind in CHILD_KINDS:
        path = collection_path(api_version, kind, namespace) + f"?labelSelector=baton.dev/deployment%3D{name}"
        for item in rest.get(path)["items"]:
            found[(kind, item["metadata"]["name"])] = item
    return found


def owners(obj: dict[str, Any]) -> set[str]:
    return {ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []}


def pods_of(rest: Rest, namespace: str, owner_uid: str) -> dict[str, dict[str, Any]]:
    """uid -> pod of every pod whose ReplicaSet belongs to a Deployment owned by `owner_uid`."""
    deployments = {
        d["metadata"]["uid"]
        for d in rest.get(collection_path("apps/v1", "Deployment", namespace))["items"]
        if owner_uid in owners(d)
    }
    replicasets = {
        rs["metadata"]["uid"]
        for rs in rest.get(f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]
        if owners(rs) & deployments
    }
    return {
        p["metadata"]["uid"]: p
        for p in rest.get(collection_path("v1", "Pod", namespace))["items"]
        if owners(p) & replicasets
    }


def reconciled(kube: Any, rest: Rest, namespace: str, name: str) -> dict[str, Any]:
    """The resource once reconciled, with a pod for each of its three Deployments."""

    def done() -> dict[str, Any] | None:
        body = get_infd(kube, namespace, name)
        if body.get("status", {}).get("observedGeneration") != 1:
            return None
        pods = pods_of(rest, namespace, body["metadata"]["uid"])
        return body if len(pods) == 3 else None

    return dict(
        wait_for(done, timeout=60, interval=0.1, message=f"{namespace}/{name} reconciled with three pods")
    )


def delete_infd(rest: Rest, namespace: str, name: str) -> None:
    path = collection_path(models.API_VERSION, models.KIND, namespace) + f"/{name}"
    status, body = rest.call("DELETE", path)
    assert status == 200, body


def test_a_deleted_resource_stays_deleted(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, keeper: str
) -> None:
    rest = Rest(own_apiserver)
    create_namespace(own_kube, "gone")
    create_infd(own_kube, "gone", "demo", SPEC)
    reconciled(own_kube, rest, "gone", "demo")
    wait_for_resyncs(operator, 2)  # the deleted resource's periodic work has run, too

    delete_infd(rest, "gone", "demo")
    wait_for(
        lambda: not children(rest, "gone", "demo"),
        timeout=60,
        interval=0.1,
        message="the garbage collector to delete every child",
    )
    wait_for(
        lambda: not pods_of_namespace(rest, "gone"),
        timeout=60,
        interval=0.1,
        message="the garbage collector to delete every pod",
    )

    paths = [collection_path(v, k, "gone") for v, k in CHILD_KINDS] + ["/api/v1/namespaces/gone/events"]
    watches = [Watch(own_apiserver, path, resource_version(own_apiserver, path)) for path in paths]
    for watch in watches:
        watch.__enter__()
    try:
        wait_for_resyncs(operator, WINDOW_RESYNCS)
    finally:
        for watch in watches:
            watch.__exit__(None, None, None)
    seen = [(kind, obj["kind"], obj["metadata"]["name"]) for w in watches for kind, obj in w.events()]
    assert seen == []


def pods_of_namespace(rest: Rest, namespace: str) -> list[str]:
    return [p["metadata"]["name"] for p in rest.get(collection_path("v1", "Pod", namespace))["items"]]


def test_a_recreated_resource_keeps_its_pods_and_owns_every_child(
    own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess, keeper: str
) -> None:
    rest = Rest(own_apiserver)
    create_namespace(own_kube, "twin")
    first = create_infd(own_kube, "twin", "twin", SPEC)
    reconciled(own_kube, rest, "twin", "twin")
    wait_for_resyncs(operator, 2)

    # Replace it twice, as a GitOps tool's "replace" does: delete, then create at once.
    for _ in range(2):
        delete_infd(rest, "twin", "twin")
        second = create_infd(own_kube, "twin", "twin", merged(SPEC, {}))
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        first = second
    uid = first["metadata"]["uid"]

    def settled() -> dict[str, dict[str, Any]] | None:
        kids = children(rest, "twin", "twin")
        if len(kids) != 14 or any(owners(obj) != {uid} for obj in kids.values()):
            return None
        pods = pods_of(rest, "twin", uid)
        everything = pods_of_namespace(rest, "twin")
        return pods if len(pods) == 3 and len(everything) == 3 else None

    pods = wait_for(
        settled,
        timeout=90,
        interval=0.1,
        message="every child owned by the new UID, its three pods and no other",
    )
    path = collection_path("v1", "Pod", "twin")
    with Watch(own_apiserver, path, resource_version(own_apiserver, path)) as watch:
        wait_for_resyncs(operator, WINDOW_RESYNCS, live=2)  # the keeper and the new twin
    deleted = [obj["metadata"]["name"] for kind, obj in watch.events() if kind == "DELETED"]
    assert deleted == []
    assert set(pods_of(rest, "twin", uid)) == set(pods)
    kids = children(rest, "twin", "twin")
    assert {key: owners(obj) for key, obj in kids.items()} == {key: {uid} for key in kids}
    assert len(kids) == 14
