"""reconcile() against a real kube-apiserver: the exact children, their field owners, status,
idempotent re-applies, drift repair, replica ownership, crash consistency, PodSecurity."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import REGISTRY

from baton_operator.events import Event
from baton_operator.kube import FIELD_MANAGER, Kube, KubeError, collection_path
from baton_operator.reconcile import Caches, OperatorConfig, reconcile, refresh_status
from baton_support.apiserver import ApiServer, Rest
from baton_support.wait import wait_for
from tests.operator_tests.cases import DEMO_APPLIED_CHILDREN, VALID_SPEC, merged
from tests.operator_tests.kube_helpers import (
    CHILD_KINDS,
    async_kube,
    create_foreign_deployment,
    create_infd,
    create_namespace,
    get_infd,
)

pytestmark = pytest.mark.k8s

CFG = OperatorConfig(operator_namespace="baton-system", monitoring_namespace="monitoring")
EXPECTED = {*DEMO_APPLIED_CHILDREN, ("Secret", "demo-kv-transfer")}


def children(rest: Rest, namespace: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of the kinds Baton writes, in `namespace`, carrying the deployment label."""
    found = {}
    for api_version, kind in CHILD_KINDS:
        path = collection_path(api_version, kind, namespace) + "?labelSelector=baton.dev/deployment%3Ddemo"
        for item in rest.get(path)["items"]:
            found[(kind, item["metadata"]["name"])] = item
    return found


def managers(obj: Mapping[str, Any]) -> set[tuple[str, str]]:
    return {(m["manager"], m["operation"]) for m in obj["metadata"].get("managedFields", [])}


async def test_first_reconcile_creates_exactly_the_children(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    outcome = await reconcile(akube, body, CFG)
    assert outcome.applied == 13  # the PodMonitor CRD is absent: skipped, not failed
    assert [e.reason for e in outcome.events] == ["SigningKeyCreated"]
    found = children(rest, namespace)
    assert set(found) == EXPECTED
    for (kind, _), obj in found.items():
        expected = {(FIELD_MANAGER, "Update" if kind == "Secret" else "Apply")}
        assert managers(obj) == expected, kind
        assert obj["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    status = get_infd(kube, namespace, "demo")["status"]
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == f"http://demo-router.{namespace}.svc:80"
    assert status["prefill"] == {
        "replicas": 0,
        "readyReplicas": 0,
        "desiredReplicas": 1,
        "ready": "0/1",
        "selector": "baton.dev/deployment=demo,baton.dev/role=prefill",
        "kvCompatKey": "9b3e36acc617fe58",
        "newKeyPods": 0,
        "oldKeyPods": 0,
        "tensorParallelSize": 1,
    }
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    # No controller manager runs here: the Deployments never get ready pods.
    assert conditions == {
        "Ready": ("False", "PodsNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }


async def test_reapplying_changes_nothing(kube: Any, akube: Kube, rest: Rest, namespace: str) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    await reconcile(akube, body, CFG)
    before = {key: obj["metadata"]["resourceVersion"] for key, obj in children(rest, namespace).items()}
    outcome = await reconcile(akube, get_infd(kube, namespace, "demo"), CFG)
    after = {key: obj["metadata"]["resourceVersion"] for key, obj in children(rest, namespace).items()}
    assert after == before
    assert outcome.events == []  # the signing key already exists: not touched


async def test_a_hand_edited_child_drifts_back(kube: Any, akube: Kube, rest: Rest, namespace: str) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    await reconcile(akube, body, CFG)
    path = collection_path("apps/v1", "Deployment", namespace) + "/demo-decode"
    patch = {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 5}}}}
    status, _ = rest.call("PATCH", path + "?fieldManager=kubectl-edit", patch, "application/merge-patch+json")
    assert status == 200
    assert rest.get(path)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5
    await reconcile(akube, body, CFG)
    assert rest.get(path)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60


async def test_replicas_belong_to_the_autoscaler_unless_off(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", merged(VALID_SPEC, {"autoscaling": {"mode": "builtin"}}))
    await reconcile(akube, body, CFG)
    path = collection_path("apps/v1", "Deployment", namespace) + "/demo-decode"
    scale = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "demo-decode"},
        "spec": {"replicas": 3},
    }
    status, _ = rest.call(
        "PATCH", path + "?fieldManager=baton-autoscaler&force=true", scale, "application/apply-patch+yaml"
    )
    assert status == 200
    await reconcile(akube, body, CFG)
    deployment = rest.get(path)
    assert deployment["spec"]["replicas"] == 3
    owned = next(m for m in deployment["metadata"]["managedFields"] if m["manager"] == FIELD_MANAGER)
    assert "f:replicas" not in owned["fieldsV1"]["f:spec"]


async def test_signing_key_is_created_once(kube: Any, akube: Kube, rest: Rest, namespace: str) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    await reconcile(akube, body, CFG)
    path = collection_path("v1", "Secret", namespace) + "/demo-kv-transfer"
    first = rest.get(path)["data"]
    await reconcile(akube, body, CFG)
    assert rest.get(path)["data"] == first
    assert len(first["kv-transfer-key"]) == 88  # base64 of 64 hex characters


async def test_events_of_a_failed_reconcile_are_reported_once(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    create_foreign_deployment(rest, namespace, "demo-decode")
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    reported: list[Event] = []
    with pytest.raises(KubeError) as failed:
        await reconcile(akube, body, CFG, on_event=reported.append)
    assert failed.value.status == 422
    assert 'Deployment.apps "demo-decode" is invalid' in str(failed.value)
    assert "spec.selector" in str(failed.value)
    assert reported == [Event("Normal", "SigningKeyCreated", "created Secret demo-kv-transfer")]

    reported.clear()
    with pytest.raises(KubeError):  # the retry: the key exists, so nothing new to report
        await reconcile(akube, get_infd(kube, namespace, "demo"), CFG, on_event=reported.append)
    assert reported == []


class Crash(Exception):
    pass


@pytest.mark.parametrize("k", [0, 1, 6, 13])
async def test_crash_after_k_writes_then_restart(
    kube: Any, akube: Kube, rest: Rest, namespace: str, k: int
) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)

    async def crash_at_k(index: int, manifest: Mapping[str, Any]) -> None:
        if index == k:
            raise Crash(f"killed before write {k}")

    with pytest.raises(Crash):
        await reconcile(akube, body, CFG, before_write=crash_at_k)
    assert len(children(rest, namespace)) == k
    stored = get_infd(kube, namespace, "demo")
    assert "observedGeneration" not in stored.get("status", {})
    assert stored["status"]["conditions"][2]["reason"] == "ReconcileFailed"

    await reconcile(akube, stored, CFG)  # the restarted operator's resume
    found = children(rest, namespace)
    assert set(found) == EXPECTED
    for (kind, _), obj in found.items():
        assert managers(obj) == {(FIELD_MANAGER, "Update" if kind == "Secret" else "Apply")}
    status = get_infd(kube, namespace, "demo")["status"]
    assert status["observedGeneration"] == 1
    assert status["conditions"][2]["reason"] == "AsExpected"


async def test_aggregated_children(kube: Any, akube: Kube, rest: Rest, namespace: str) -> None:
    body = create_infd(kube, namespace, "demo", {**VALID_SPEC, "mode": "aggregated"})
    await reconcile(akube, body, CFG)
    names = {
        key for key in children(rest, namespace) if key[0] in ("Deployment", "Service", "PodDisruptionBudget")
    }
    assert names == {
        ("Deployment", "demo-engine"),
        ("Deployment", "demo-router"),
        ("Service", "demo-engine"),
        ("Service", "demo-router"),
        ("PodDisruptionBudget", "demo-engine"),
        ("PodDisruptionBudget", "demo-router"),
    }
    status = get_infd(kube, namespace, "demo")["status"]
    assert status["pool"]["ready"] == "0/1"
    assert "prefill" not in status


async def test_disabling_the_network_policy_deletes_it(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    await reconcile(akube, body, CFG)
    assert ("NetworkPolicy", "demo-engines") in children(rest, namespace)
    off = {**body, "spec": merged(body["spec"], {"networkPolicy": {"enabled": False}})}
    outcome = await reconcile(akube, off, CFG)
    assert ("NetworkPolicy", "demo-engines") not in children(rest, namespace)
    assert [e.reason for e in outcome.events] == ["ChildRemoved"]


async def test_engine_pods_pass_restricted_pod_security(kube: Any, akube: Kube, rest: Rest) -> None:
    namespace = "restricted"
    create_namespace(kube, namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    spec = merged(VALID_SPEC, {"model": {"source": "hf:org/name", "hfTokenSecret": {"name": "t"}}})
    body = create_infd(kube, namespace, "demo", spec)
    await reconcile(akube, body, CFG)
    pods = collection_path("v1", "Pod", namespace) + "?dryRun=All"
    for name in ("demo-prefill", "demo-decode", "demo-router"):
        template = rest.get(collection_path("apps/v1", "Deployment", namespace) + f"/{name}")["spec"][
            "template"
        ]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-x"}, "spec": template["spec"]}
        status, answer = rest.call("POST", pods, pod)
        assert status == 201, answer
    # The control: the same namespace refuses a pod without the restricted settings.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"}}
    plain["spec"] = {"containers": [{"name": "c", "image": "busybox"}]}
    status, answer = rest.call("POST", pods, plain)
    assert status == 403
    assert 'violates PodSecurity "restricted:latest"' in answer["message"]


PODMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


async def test_pod_monitor_is_applied_once_its_crd_exists(
    apiserver: ApiServer, kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    from baton_support.operator_process import CLUSTER_PATHS, wait_established

    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    assert (await reconcile(akube, body, CFG)).applied == 13
    crds = CLUSTER_PATHS["CustomResourceDefinition"]
    status, answer = rest.call("POST", crds, PODMONITOR_CRD)
    assert status == 201, answer
    try:
        wait_established(rest, "podmonitors.monitoring.coreos.com")
        assert (await reconcile(akube, body, CFG)).applied == 13  # "absent" is cached for a while
        fresh = async_kube(apiserver)  # e.g. after CRD_CACHE_SECONDS, or a restarted operator
        try:
            assert (await reconcile(fresh, body, CFG)).applied == 14
        finally:
            await fresh.close()
        monitor = rest.get(f"/apis/monitoring.coreos.com/v1/namespaces/{namespace}/podmonitors/demo")
        assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics"}]
        assert managers(monitor) == {(FIELD_MANAGER, "Apply")}
    finally:
        rest.call("DELETE", f"{crds}/podmonitors.monitoring.coreos.com")
        # Deletion is asynchronous: a terminating CRD still "exists" and refuses creates, which
        # would break the next test's reconcile. Wait until it is gone.
        wait_for(
            lambda: rest.call("GET", f"{crds}/podmonitors.monitoring.coreos.com")[0] == 404,
            timeout=30,
            interval=0.1,
            message="the PodMonitor CRD to be deleted",
        )


async def test_rotated_credentials_are_reloaded_after_a_401(
    apiserver: ApiServer, kube: Any, namespace: str
) -> None:
    import kopf

    tokens = iter(["expired-token", apiserver.token])

    def credentials() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=apiserver.url, ca_path=str(apiserver.ca_file), token=next(tokens))

    client = Kube(credentials)
    try:
        body = create_infd(kube, namespace, "demo", VALID_SPEC)
        assert (await reconcile(client, body, CFG)).applied == 13
    finally:
        await client.close()


async def test_reconcile_keeps_the_autoscalers_status(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", merged(VALID_SPEC, {"autoscaling": {"mode": "builtin"}}))
    decision = {
        "lastDecision": {"prefill": 2, "decode": 3},
        "reason": "decode KV usage 0.91 > 0.70",
        "metrics": {"decode.kv_usage": 0.91},
        "time": "2026-01-01T00:00:00Z",
    }
    path = f"/apis/baton.dev/v1alpha1/namespaces/{namespace}/inferencedeployments/demo/status"
    patch = {"status": {"autoscaling": decision}}
    status, answer = rest.call("PATCH", path, patch, "application/merge-patch+json")
    assert status == 200, answer
    await reconcile(akube, get_infd(kube, namespace, "demo"), CFG)
    stored = get_infd(kube, namespace, "demo")["status"]
    assert stored["autoscaling"] == decision  # the schema accepted it and the operator left it alone
    assert stored["observedGeneration"] == 1
    assert body["metadata"]["generation"] == 1


def requests_sent(verb: str, resource: str) -> float:
    sample = REGISTRY.get_sample_value(
        "baton_operator_api_requests_total", {"verb": verb, "resource": resource}
    )
    return sample or 0.0


async def test_a_child_refresh_reads_the_caches_and_patches_only_changes(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    caches = Caches()
    await reconcile(akube, create_infd(kube, namespace, "demo", VALID_SPEC), CFG, caches=caches)
    # A spec change that no reconcile has applied yet: a refresh must not claim generation 2.
    infd = f"/apis/baton.dev/v1alpha1/namespaces/{namespace}/inferencedeployments/demo"
    code, answer = rest.call(
        "PATCH", infd, {"spec": {"engine": {"maxNumSeqs": 9}}}, "application/merge-patch+json"
    )
    assert code == 200 and answer["metadata"]["generation"] == 2, answer
    caches.owners.observe(answer)  # what the watch delivers
    for role in ("prefill", "decode", "router"):
        path = collection_path("apps/v1", "Deployment", namespace) + f"/demo-{role}"
        status = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
        code, ready = rest.call("PATCH", path + "/status", {"status": status}, "application/merge-patch+json")
        assert code == 200, ready
        assert caches.deployments.observe(ready) is True  # the watch event of the controller's write

    reads_before = (requests_sent("GET", "deployments"), requests_sent("GET", "inferencedeployments"))
    patches_before = requests_sent("PATCH", "inferencedeployments/status")
    await refresh_status(akube, caches, namespace, "demo")
    stored = get_infd(kube, namespace, "demo")
    status = stored["status"]
    assert status["observedGeneration"] == 1
    assert (status["prefill"]["ready"], status["decode"]["ready"], status["router"]["ready"]) == ("1/1",) * 3
    conditions = {
        c["type"]: (c["status"], c["reason"], c["observedGeneration"]) for c in status["conditions"]
    }
    assert conditions == {
        "Ready": ("True", "AllPodsReady", 1),
        "Progressing": ("False", "Stable", 1),
        "Degraded": ("False", "AsExpected", 1),
    }
    await refresh_status(akube, caches, namespace, "demo")  # nothing changed: nothing sent
    assert (
        get_infd(kube, namespace, "demo")["metadata"]["resourceVersion"]
        == stored["metadata"]["resourceVersion"]
    )
    assert (requests_sent("GET", "deployments"), requests_sent("GET", "inferencedeployments")) == reads_before
    assert requests_sent("PATCH", "inferencedeployments/status") == patches_before + 1


async def test_a_refresh_keeps_a_failed_reconciles_error(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    caches = Caches()
    body = create_infd(kube, namespace, "demo", VALID_SPEC)

    async def crash_at_3(index: int, manifest: Mapping[str, Any]) -> None:
        if index == 3:
            raise Crash("killed before write 3")

    with pytest.raises(Crash):
        await reconcile(akube, body, CFG, before_write=crash_at_3, caches=caches)
    await refresh_status(akube, caches, namespace, "demo")
    status = get_infd(kube, namespace, "demo")["status"]
    degraded = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert [(c["status"], c["reason"], c["message"]) for c in degraded] == [
        ("True", "ReconcileFailed", "Crash: killed before write 3")
    ]
    assert "observedGeneration" not in status
