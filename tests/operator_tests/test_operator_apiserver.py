"""`baton-operator run` as a process, as the chart's ServiceAccount (not admin), on a real API
server: reconcile on create and update, periodic drift repair, status, Events, metrics,
liveness, no finalizers, baton.dev bookkeeping, and RBAC that refuses reading Secrets."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from baton_operator.kube import FIELD_MANAGER, collection_path
from baton_support.apiserver import ApiServer, Rest
from baton_support.operator_process import OperatorProcess, operator_process
from baton_support.wait import wait_for
from tests.operator_tests.cases import VALID_SPEC
from tests.operator_tests.kube_helpers import (
    create_foreign_deployment,
    create_infd,
    create_namespace,
    get_infd,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

INFD = "/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments/{name}"


@pytest.fixture(scope="module")
def operator(own_apiserver: ApiServer, chart_installed: Any) -> Iterator[OperatorProcess]:
    kubeconfig, _ = chart_installed
    with operator_process(kubeconfig, own_apiserver.workdir, "--resync-seconds=2") as proc:
        yield proc


@pytest.fixture(scope="module")
def reconciled(own_kube: Any, operator: OperatorProcess, own_apiserver: ApiServer) -> dict[str, Any]:
    create_namespace(own_kube, "op")
    create_infd(own_kube, "op", "demo", VALID_SPEC)

    def handled() -> dict[str, Any] | None:
        body = get_infd(own_kube, "op", "demo")
        done = body.get("status", {}).get("observedGeneration") == 1
        # Kopf records the handled spec after the handler returns, after the status patch.
        recorded = "baton.dev/last-handled-configuration" in body["metadata"].get("annotations", {})
        return body if done and recorded else None

    return dict(
        wait_for(
            handled, timeout=60, interval=0.1, message="status.observedGeneration == 1 and Kopf's record"
        )
    )


def test_children_status_and_bookkeeping(reconciled: dict[str, Any], own_apiserver: ApiServer) -> None:
    rest = Rest(own_apiserver)
    deployments = rest.get(collection_path("apps/v1", "Deployment", "op"))["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        "demo-decode",
        "demo-prefill",
        "demo-router",
    ]
    for d in deployments:
        assert {m["manager"] for m in d["metadata"]["managedFields"]} == {FIELD_MANAGER}
    meta = reconciled["metadata"]
    assert meta.get("finalizers", []) == []
    annotations = meta.get("annotations", {})
    assert "baton.dev/last-handled-configuration" in annotations
    assert [k for k in annotations if not k.startswith("baton.dev/")] == []  # no kopf.zalando.org/*
    conditions = {c["type"]: c["reason"] for c in reconciled["status"]["conditions"]}
    assert conditions == {"Ready": "PodsNotReady", "Progressing": "RollingOut", "Degraded": "AsExpected"}


def test_events_are_posted(reconciled: dict[str, Any], own_apiserver: ApiServer) -> None:
    rest = Rest(own_apiserver)

    def reasons() -> set[str] | None:
        found = {e["reason"] for e in rest.get("/api/v1/namespaces/op/events")["items"]}
        return found if {"SigningKeyCreated", "Reconciled"} <= found else None

    assert wait_for(reasons, timeout=20, interval=0.1, message="SigningKeyCreated and Reconciled events")


def test_operator_cannot_read_secrets(
    reconciled: dict[str, Any], own_apiserver: ApiServer, chart_installed: Any
) -> None:
    _, token = chart_installed
    as_operator = Rest(own_apiserver, token)
    secret = collection_path("v1", "Secret", "op") + "/demo-kv-transfer"
    for path in (secret, collection_path("v1", "Secret", "op"), "/api/v1/secrets"):
        status, body = as_operator.call("GET", path)
        assert status == 403, (path, body)
        assert (
            'cannot get resource "secrets"' in body["message"]
            or 'cannot list resource "secrets"' in body["message"]
        )
    status, _ = Rest(own_apiserver).call("GET", secret)  # it exists: the operator created it
    assert status == 200


def test_periodic_reconcile_repairs_a_hand_edit(reconciled: dict[str, Any], own_apiserver: ApiServer) -> None:
    rest = Rest(own_apiserver)
    path = collection_path("apps/v1", "Deployment", "op") + "/demo-prefill"
    patch = {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 7}}}}
    status, _ = rest.call("PATCH", path + "?fieldManager=kubectl-edit", patch, "application/merge-patch+json")
    assert status == 200

    def repaired() -> bool:
        return bool(rest.get(path)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60)

    wait_for(
        repaired,
        timeout=20,
        interval=0.1,
        message="the resync timer to restore terminationGracePeriodSeconds",
    )


def test_spec_change_reaches_the_pod_template(
    reconciled: dict[str, Any], own_apiserver: ApiServer, own_kube: Any
) -> None:
    rest = Rest(own_apiserver)
    status, body = rest.call(
        "PATCH",
        INFD.format(ns="op", name="demo"),
        {"spec": {"engine": {"maxNumSeqs": 17}}},
        "application/merge-patch+json",
    )
    assert status == 200, body
    path = collection_path("apps/v1", "Deployment", "op") + "/demo-decode"

    def updated() -> bool:
        args = rest.get(path)["spec"]["template"]["spec"]["containers"][0]["args"]
        return bool(args[args.index("--max-num-seqs") + 1] == "17")

    wait_for(updated, timeout=30, interval=0.1, message="--max-num-seqs 17 in the decode pod template")
    wait_for(
        lambda: get_infd(own_kube, "op", "demo")["status"].get("observedGeneration") == 2,
        timeout=30,
        interval=0.1,
        message="generation 2",
    )


def test_metrics_and_liveness(reconciled: dict[str, Any], operator: OperatorProcess) -> None:
    text = operator.metrics()
    created = re.search(r'baton_operator_reconciles_total\{result="ok",trigger="create"\} (\S+)', text)
    assert created is not None and float(created.group(1)) == 1.0
    assert "baton_operator_reconcile_duration_seconds_bucket" in text
    assert "baton_operator_reconcile_errors_total" in text or "baton_operator_reconcile_errors" in text


def test_peering_keeps_one_replica_active(
    reconciled: dict[str, Any],
    operator: OperatorProcess,
    own_apiserver: ApiServer,
    chart_installed: Any,
    own_kube: Any,
) -> None:
    kubeconfig, _ = chart_installed
    rest = Rest(own_apiserver)
    with operator_process(kubeconfig, own_apiserver.workdir, "--resync-seconds=2") as second:
        peering = "/apis/kopf.dev/v1/clusterkopfpeerings/baton-operator"
        peers = wait_for(
            lambda: (s := rest.get(peering).get("status") or {}) and len(s) == 2 and s,
            timeout=30,
            interval=0.1,
            message="2 peers",
        )
        priorities = [p["priority"] for p in peers.values()]
        assert len(set(priorities)) == 2
        create_infd(own_kube, "op", "second", VALID_SPEC)
        wait_for(
            lambda: get_infd(own_kube, "op", "second").get("status", {}).get("observedGeneration") == 1,
            timeout=30,
            interval=0.1,
            message="the active replica to reconcile",
        )
        pattern = r'baton_operator_reconciles_total\{result="ok",trigger="create"\} (\S+)'

        def creates(proc: OperatorProcess) -> float:
            found = re.search(pattern, proc.metrics())
            return float(found.group(1)) if found else 0.0

        # The counter moves just after the status patch: poll it rather than race it.
        wait_for(
            lambda: creates(operator) == 2.0,
            timeout=30,
            interval=0.1,
            message="the first replica's second create",
        )
        assert creates(second) == 0.0  # the standby never reconciled


def _mark_ready(rest: Rest, namespace: str, name: str) -> None:
    """Write what the Deployment controller would once every pod is Ready (no controller runs)."""
    path = collection_path("apps/v1", "Deployment", namespace) + f"/{name}"
    generation = rest.get(path)["metadata"]["generation"]
    status = {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    code, body = rest.call("PATCH", path + "/status", {"status": status}, "application/merge-patch+json")
    assert code == 200, body


def sample(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_child_readiness_reaches_status_and_printer_columns(
    reconciled: dict[str, Any], own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess
) -> None:
    rest = Rest(own_apiserver)
    refreshes = sample(operator.metrics(), "baton_operator_status_refreshes_total")
    for name in ("demo-prefill", "demo-decode", "demo-router"):
        _mark_ready(rest, "op", name)

    def ready() -> bool:
        conditions = get_infd(own_kube, "op", "demo")["status"]["conditions"]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    wait_for(ready, timeout=30, interval=0.1, message="Ready=True from the child Deployments' status")
    # The child events also ran a status refresh (the 2 s resync may have written Ready first).
    wait_for(
        lambda: sample(operator.metrics(), "baton_operator_status_refreshes_total") > refreshes,
        timeout=30,
        interval=0.1,
        message="a status refresh after the child Deployments' status changes",
    )
    # The operator's status patches never start a reconcile: the only update is the spec change.
    updates = 'baton_operator_reconciles_total{result="ok",trigger="update"}'
    # (counted just after that reconcile's status patch, which is all the spec-change test waited for)
    wait_for(
        lambda: sample(operator.metrics(), updates) == 1.0,
        timeout=30,
        interval=0.1,
        message="exactly one update reconcile",
    )
    status = get_infd(own_kube, "op", "demo")["status"]
    assert (status["prefill"]["ready"], status["decode"]["ready"], status["router"]["ready"]) == ("1/1",) * 3
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Progressing"] == ("False", "Stable")

    # `kubectl get infd`: the server renders the printer columns as a Table.
    req = urllib.request.Request(
        own_apiserver.url + "/apis/baton.dev/v1alpha1/namespaces/op/inferencedeployments/demo"
    )
    req.add_header("Authorization", f"Bearer {own_apiserver.token}")
    req.add_header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
    with urllib.request.urlopen(req, context=rest.ctx) as resp:
        table = json.loads(resp.read())
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == ["Name", "Model", "Mode", "Prefill", "Decode", "Pool", "Ready", "Endpoint", "Age"]
    cells = dict(zip(columns, table["rows"][0]["cells"], strict=True))
    assert (cells["Name"], cells["Model"], cells["Mode"]) == ("demo", "smollm2", "disaggregated")
    assert (cells["Prefill"], cells["Decode"], cells["Ready"]) == ("1/1", "1/1", "True")
    assert cells["Endpoint"] == "http://demo-router.op.svc:80"


SCHEDULER = "0/3 nodes are available: 3 Insufficient amd.com/gpu. preemption: 0/3 nodes are available."


def test_a_stuck_pool_says_why(reconciled: dict[str, Any], own_apiserver: ApiServer, own_kube: Any) -> None:
    """A decode pod the scheduler cannot place (its status written here as the scheduler writes
    it: no scheduler runs on this API server), then one that crash-loops: the pod watch turns
    each into the conditions' reason, with the scheduler's and the kubelet's own words."""
    rest = Rest(own_apiserver)
    pods = collection_path("v1", "Pod", "op")
    labels = {
        "baton.dev/deployment": "demo",
        "baton.dev/role": "decode",
        "app.kubernetes.io/managed-by": "baton-operator",
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo-decode-stuck", "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "baton"}]},
    }
    status, body = rest.call("POST", pods, pod)
    assert status == 201, body

    def write_status(pod_status: dict[str, Any]) -> None:
        code, answer = rest.call(
            "PATCH",
            f"{pods}/demo-decode-stuck/status",
            {"status": pod_status},
            "application/merge-patch+json",
        )
        assert code == 200, answer

    def degraded() -> tuple[str, str, str]:
        conditions = get_infd(own_kube, "op", "demo")["status"]["conditions"]
        return next((c["status"], c["reason"], c["message"]) for c in conditions if c["type"] == "Degraded")

    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": SCHEDULER,
    }
    write_status({"phase": "Pending", "conditions": [unschedulable]})
    stuck = f"decode: pod demo-decode-stuck is unschedulable: {SCHEDULER}"
    wait_for(
        lambda: degraded() == ("True", "PodsUnschedulable", stuck),
        timeout=30,
        interval=0.1,
        message="Degraded=True PodsUnschedulable",
    )

    crash = {
        "name": "engine",
        "ready": False,
        "started": False,
        "restartCount": 3,
        "state": {
            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}
        },
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
    }
    scheduled = {"type": "PodScheduled", "status": "True"}
    write_status({"phase": "Running", "conditions": [scheduled], "containerStatuses": [crash]})
    looping = (
        "decode: pod demo-decode-stuck container engine: CrashLoopBackOff "
        "(restarted 3 times, last exit 2 Error): back-off 40s restarting failed container"
    )
    wait_for(
        lambda: degraded() == ("True", "CrashLooping", looping),
        timeout=30,
        interval=0.1,
        message="Degraded=True CrashLooping",
    )

    status, body = rest.call("DELETE", f"{pods}/demo-decode-stuck?gracePeriodSeconds=0")
    assert status == 200, body
    wait_for(
        lambda: degraded() == ("False", "AsExpected", "no failures observed"),
        timeout=30,
        interval=0.1,
        message="Degraded=False again",
    )


def reconcile_errors(operator: OperatorProcess, error: str) -> float:
    return sample(operator.metrics(), f'baton_operator_reconcile_errors_total{{error="{error}"}}')


def test_a_refused_child_degrades_the_resource_once_and_is_retried(
    reconciled: dict[str, Any], own_apiserver: ApiServer, own_kube: Any, operator: OperatorProcess
) -> None:
    # Last in the module: the resource's eventual successful create would count in the metrics
    # asserted above.
    rest = Rest(own_apiserver)
    create_namespace(own_kube, "failing")
    create_foreign_deployment(rest, "failing", "broken-decode")
    refused_before = reconcile_errors(operator, "HTTP422")
    create_infd(own_kube, "failing", "broken", VALID_SPEC)

    def posted(reason: str) -> list[str]:
        events = rest.get("/api/v1/namespaces/failing/events")["items"]
        return [
            e["message"] for e in events if e["reason"] == reason and e["involvedObject"]["name"] == "broken"
        ]

    def conditions() -> dict[str, tuple[str, str, str]]:
        status = get_infd(own_kube, "failing", "broken").get("status") or {}
        return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status.get("conditions", [])}

    # The Secret is created, then the decode Deployment is refused (its selector is immutable):
    # the status says so with the API's answer, Ready and Degraded alike.
    degraded = wait_for(
        lambda: (c := conditions()).get("Degraded", ("", "", ""))[1] == "ChildRefused" and c["Degraded"],
        timeout=30,
        interval=0.1,
        message="Degraded=True ChildRefused",
    )
    status, reason, message = degraded
    assert (status, reason) == ("True", "ChildRefused")
    assert message.startswith(
        'Deployment broken-decode: Invalid (HTTP 422): Deployment.apps "broken-decode" is invalid: '
    )
    assert "spec.selector" in message and "field is immutable" in message
    assert conditions()["Ready"] == ("False", "ChildRefused", message)
    # Retried (every resync: 2 s here), each refusal counted, but one Warning Event in all.
    wait_for(
        lambda: reconcile_errors(operator, "HTTP422") >= refused_before + 3,
        timeout=30,
        interval=0.1,
        message="three refused reconciles",
    )
    wait_for(lambda: posted("ChildRefused"), timeout=30, interval=0.1, message="the ChildRefused Event")
    assert posted("ChildRefused") == [message]
    assert posted("SigningKeyCreated") == ["created Secret broken-kv-transfer"]

    status_code, answer = rest.call(
        "DELETE", collection_path("apps/v1", "Deployment", "failing") + "/broken-decode"
    )
    assert status_code == 200, answer
    wait_for(
        lambda: get_infd(own_kube, "failing", "broken").get("status", {}).get("observedGeneration") == 1,
        timeout=30,
        interval=0.1,
        message="a reconcile to succeed once the foreign Deployment is gone",
    )
    assert conditions()["Degraded"] == ("False", "AsExpected", "no failures observed")
    assert posted("ChildRefused") == [message]
    assert posted("SigningKeyCreated") == ["created Secret broken-kv-transfer"]
    status_code, answer = rest.call("DELETE", INFD.format(ns="failing", name="broken"))
    assert status_code == 200, answer
