"""The Gateway API Inference Extension's InferencePool: the pure builder, then the pool against the
real CRD of a GIE release (read from its Go module) on a real API server, and on the full local
control plane the pods it selects: exactly the engine pods, with llm-d's role labels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from baton_dev import ecosystem_crds
from baton_dev import spec as cluster_spec
from baton_dev.testing import DevCluster
from baton_engine import contract
from baton_operator import crd
from baton_operator.builders import BuildContext, Owner, desired_children
from baton_operator.kube import FIELD_MANAGER, Kube
from baton_operator.models import InferenceDeploymentSpec
from baton_operator.reconcile import OperatorConfig, reconcile
from baton_support.apiserver import ApiServer, Rest
from baton_support.operator_process import CLUSTER_PATHS, wait_established
from baton_support.wait import wait_for
from tests.operator_tests.cases import VALID_SPEC, merged
from tests.operator_tests.kube_helpers import (
    async_kube,
    create_infd,
    dev_cluster_kube,
    install_crd_in,
)

CRD = ecosystem_crds.GIE_INFERENCE_POOL
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
OWNER = Owner(name="demo", namespace="llm", uid="0f1e-uid")
AGGREGATED: dict[str, Any] = {"mode": "aggregated"}


def children(patch: dict[str, Any] | None = None) -> Any:
    spec = InferenceDeploymentSpec.model_validate(merged(VALID_SPEC, patch or {}))
    return desired_children(BuildContext(owner=OWNER, spec=spec), "ab" * 32)


def pool_of(patch: dict[str, Any] | None = None) -> dict[str, Any]:
    (pool,) = [m for crd, m in children(patch).optional if crd == CRD.name]
    return pool


def pod_labels(patch: dict[str, Any] | None = None) -> dict[str, dict[str, str]]:
    """Deployment name -> its pod template's labels."""
    return {
        m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"]
        for m in children(patch).applied
        if m["kind"] == "Deployment"
    }


# --------------------------------------------------------------------------- the pure builder


def test_pool_of_a_disaggregated_deployment() -> None:
    pool = pool_of()
    assert (pool["apiVersion"], pool["kind"], pool["metadata"]["name"]) == (
        "inference.networking.k8s.io/v1",
        "InferencePool",
        "demo",
    )
    assert pool["spec"] == {
        "selector": {"matchLabels": {"baton.dev/deployment": "demo", "baton.dev/engine": "true"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": "demo-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert pool["metadata"]["labels"]["app.kubernetes.io/component"] == "inference-pool"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "0f1e-uid"
    assert [crd for crd, _ in children().optional] == ["podmonitors.monitoring.coreos.com", CRD.name]


def test_pool_follows_the_engine_port_and_the_configured_picker() -> None:
    pool = pool_of(
        {
            "engine": {"port": 9100},
            "inferencePool": {
                "endpointPicker": {"name": "shared-epp", "port": 65535, "failureMode": "FailOpen"}
            },
        }
    )
    assert pool["spec"]["targetPorts"] == [{"number": 9100}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "shared-epp",
        "port": {"number": 65535},
        "failureMode": "FailOpen",
    }


def test_a_disabled_pool_is_removed_not_applied() -> None:
    built = children({"inferencePool": {"enabled": False}})
    assert [crd for crd, _ in built.optional] == ["podmonitors.monitoring.coreos.com"]
    assert built.removed == [("inference.networking.k8s.io/v1", "InferencePool", "demo")]


def test_engine_pods_carry_llm_d_roles_and_the_pool_label_the_router_neither() -> None:
    labels = pod_labels()
    assert labels["demo-prefill"]["llm-d.ai/role"] == "prefill"
    assert labels["demo-decode"]["llm-d.ai/role"] == "decode"
    for name in ("demo-prefill", "demo-decode"):
        assert labels[name]["baton.dev/engine"] == "true"
    assert "llm-d.ai/role" not in labels["demo-router"]
    assert "baton.dev/engine" not in labels["demo-router"]
    aggregated = pod_labels(AGGREGATED)
    assert aggregated["demo-engine"]["llm-d.ai/role"] == "prefill-decode"
    assert aggregated["demo-engine"]["baton.dev/engine"] == "true"
    # Only pod templates: the Deployments' selectors (immutable) keep Baton's two labels.
    for manifest in children().applied:
        if manifest["kind"] == "Deployment":
            assert set(manifest["spec"]["selector"]["matchLabels"]) == {
                "baton.dev/deployment",
                "baton.dev/role",
            }
            assert "llm-d.ai/role" not in manifest["metadata"]["labels"]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"port": 0}, "port"),
        ({"port": 65536}, "port"),
        ({"name": "Bad_Name"}, "name"),
        ({"failureMode": "Sometimes"}, "failureMode"),
    ],
)
def test_models_refuse_a_bad_picker(patch: dict[str, Any], field: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        InferenceDeploymentSpec.model_validate(
            merged(VALID_SPEC, {"inferencePool": {"endpointPicker": patch}})
        )
    assert err.value.errors()[0]["loc"] == ("inferencePool", "endpointPicker", field)


# --------------------------------------------------------------------------- a real API server


def _gie_crd() -> dict[str, Any]:
    try:
        return ecosystem_crds.load(CRD)
    except ecosystem_crds.ModuleUnavailable as exc:
        pytest.skip(f"the GIE release's Go module is not available: {exc}")


def _delete_crd(rest: Rest) -> None:
    path = f"{CLUSTER_PATHS['CustomResourceDefinition']}/{CRD.name}"
    rest.call("DELETE", path)
    # A terminating CRD still "exists": wait until it is gone, for the next module's counts.
    wait_for(
        lambda: rest.call("GET", path)[0] == 404,
        timeout=60,
        interval=0.1,
        message="the InferencePool CRD to be deleted",
    )


@pytest.fixture(scope="module")
def gie_crd(apiserver: ApiServer, kube: Any) -> Iterator[dict[str, Any]]:
    """The release's InferencePool CRD installed for this module (other modules count children
    without it), deleted afterwards."""
    crd = _gie_crd()
    rest = Rest(apiserver)
    status, answer = rest.call("POST", CLUSTER_PATHS["CustomResourceDefinition"], crd)
    assert status == 201, answer
    try:
        wait_established(rest, CRD.name)
        yield crd
    finally:
        _delete_crd(rest)


CFG = OperatorConfig()


@pytest.mark.k8s
async def test_without_the_crd_the_reconcile_skips_the_pool(
    kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    outcome = await reconcile(akube, body, CFG)
    assert outcome.applied == 13  # neither optional child: both CRDs are absent
    assert outcome.status["conditions"][0]["reason"] != "ReconcileFailed"
    assert rest.call("GET", f"{CLUSTER_PATHS['CustomResourceDefinition']}/{CRD.name}")[0] == 404


@pytest.mark.k8s
async def test_pool_is_accepted_by_the_release_crd(
    gie_crd: dict[str, Any], kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    assert gie_crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    body = create_infd(kube, namespace, "demo", VALID_SPEC)
    assert (await reconcile(akube, body, CFG)).applied == 14
    pool = rest.get(POOLS.format(ns=namespace) + "/demo")
    # As stored: the release CRD's defaults filled in (appProtocol, the picker's core group).
    assert pool["spec"] == {
        "selector": {"matchLabels": {"baton.dev/deployment": "demo", "baton.dev/engine": "true"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "demo-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert {m["manager"] for m in pool["metadata"]["managedFields"]} == {FIELD_MANAGER}
    assert pool["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]


@pytest.mark.k8s
async def test_switching_the_pool_off_and_on_and_changing_the_picker(
    gie_crd: dict[str, Any], kube: Any, akube: Kube, rest: Rest, namespace: str
) -> None:
    body = create_infd(kube, namespace, "demo", merged(VALID_SPEC, AGGREGATED))
    await reconcile(akube, body, CFG)
    pool = rest.get(POOLS.format(ns=namespace) + "/demo")
    assert pool["spec"]["selector"]["matchLabels"] == {
        "baton.dev/deployment": "demo",
        "baton.dev/engine": "true",
    }

    picker = {
        "inferencePool": {"endpointPicker": {"name": "shared-epp", "port": 65535, "failureMode": "FailOpen"}}
    }
    body = {**body, "spec": merged(body["spec"], picker)}
    await reconcile(akube, body, CFG)
    ref = rest.get(POOLS.format(ns=namespace) + "/demo")["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("shared-epp", {"number": 65535}, "FailOpen")

    body = {**body, "spec": merged(body["spec"], {"inferencePool": {"enabled": False}})}
    outcome = await reconcile(akube, body, CFG)
    assert [(e.reason, e.message) for e in outcome.events] == [("ChildRemoved", "deleted InferencePool demo")]
    assert rest.call("GET", POOLS.format(ns=namespace) + "/demo")[0] == 404
    assert (await reconcile(akube, body, CFG)).events == []  # already gone: nothing to report

    body = {**body, "spec": merged(body["spec"], {"inferencePool": {"enabled": True}})}
    await reconcile(akube, body, CFG)
    assert rest.get(POOLS.format(ns=namespace) + "/demo")["spec"]["endpointPickerRef"]["name"] == "shared-epp"


@pytest.mark.k8s
def test_the_api_server_refuses_a_picker_port_past_its_limit(kube: Any, rest: Rest, namespace: str) -> None:
    infds = f"/apis/baton.dev/v1alpha1/namespaces/{namespace}/inferencedeployments"
    for port, expected in ((65535, 201), (65536, 422)):
        spec = merged(VALID_SPEC, {"inferencePool": {"endpointPicker": {"port": port}}})
        doc = {
            "apiVersion": "baton.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": f"p{port}"},
        }
        status, answer = rest.call("POST", infds, {**doc, "spec": spec})
        assert status == expected, answer
    assert "spec.inferencePool.endpointPicker.port" in answer["message"]


@pytest.mark.k8s
async def test_a_crd_deleted_while_cached_as_present_does_not_fail_the_reconcile(
    gie_crd: dict[str, Any], apiserver: ApiServer, kube: Any, rest: Rest, namespace: str
) -> None:
    akube = async_kube(apiserver)
    try:
        body = create_infd(kube, namespace, "demo", VALID_SPEC)
        assert (await reconcile(akube, body, CFG)).applied == 14  # caches "present"
        _delete_crd(rest)
        outcome = await reconcile(akube, body, CFG)  # the cache still says present
        assert outcome.applied == 13
        assert outcome.status["conditions"][2]["reason"] == "AsExpected"  # Degraded: no failure
        assert await akube.crd_exists(CRD.name) is False  # the refusal corrected the cache
    finally:
        await akube.close()
        # The module's other tests (and its teardown) expect the CRD back.
        if rest.call("GET", f"{CLUSTER_PATHS['CustomResourceDefinition']}/{CRD.name}")[0] == 404:
            status, answer = rest.call("POST", CLUSTER_PATHS["CustomResourceDefinition"], gie_crd)
            assert status == 201, answer
            wait_established(rest, CRD.name)


# --------------------------------------------------------------------------- the full control plane

KWOK = {cluster_spec.NODE_TYPE_LABEL: "kwok"}
ON_KWOK = {"nodeSelector": KWOK, "tolerations": [cluster_spec.KWOK_TOLERATION]}
SMALL = {"resources": {"gpus": 0, "cpu": "100m", "memory": "256Mi"}, **ON_KWOK}


@pytest.fixture(scope="module")
def cluster_crds(dev_cluster: DevCluster) -> Iterator[None]:
    """Baton's CRD (kept: other modules install the same file) and the GIE release's InferencePool
    CRD (deleted afterwards)."""
    gie = _gie_crd()
    install_crd_in(dev_cluster, crd.crd())
    install_crd_in(dev_cluster, gie)
    path = f"{CLUSTER_PATHS['CustomResourceDefinition']}/{CRD.name}"
    try:
        yield
    finally:
        dev_cluster.admin.delete(path)
        wait_for(
            lambda: not dev_cluster.exists(path),
            timeout=60,
            interval=0.1,
            message="the InferencePool CRD to be deleted",
        )


def selected(cluster: DevCluster, namespace: str, match_labels: dict[str, str]) -> set[str]:
    return {p["metadata"]["name"] for p in cluster.pods(namespace, contract.selector_arg(match_labels))}


@pytest.mark.k8s
@pytest.mark.slow
async def test_pool_selects_exactly_the_engine_pods(
    dev_cluster: DevCluster, cluster_crds: None, k8s_namespace: str
) -> None:
    """Two deployments side by side (one disaggregated, one aggregated), their pods made by the
    real controllers: each pool selects its own engine pods and nothing else."""
    ns = k8s_namespace
    specs = {
        "pd": merged(VALID_SPEC, {"autoscaling": {"mode": "off"}, "prefill": {"replicas": 2, **SMALL},
                                  "decode": {"replicas": 1, **SMALL}, "router": ON_KWOK}),
        "agg": merged(VALID_SPEC, {"mode": "aggregated", "autoscaling": {"mode": "off"},
                                   "pool": {"replicas": 2, **SMALL}, "router": ON_KWOK}),
    }  # fmt: skip
    kube = dev_cluster_kube(dev_cluster)
    try:
        for name, spec in specs.items():
            doc = {
                "apiVersion": "baton.dev/v1alpha1",
                "kind": "InferenceDeployment",
                "metadata": {"name": name},
            }
            body = dev_cluster.admin.post(
                f"/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments", {**doc, "spec": spec}
            )
            await reconcile(kube, body, CFG)
    finally:
        await kube.close()
    want = {
        ("pd", "prefill"): 2,
        ("pd", "decode"): 1,
        ("pd", "router"): 1,
        ("agg", "engine"): 2,
        ("agg", "router"): 1,
    }

    def pods_by_role() -> dict[tuple[str, str], set[str]] | None:
        found = {key: selected(dev_cluster, ns, contract.pod_selector(*key)) for key in want}
        return found if {k: len(v) for k, v in found.items()} == want else None

    try:
        pods = wait_for(pods_by_role, timeout=180, interval=0.1, message="every pod of both deployments")
    except AssertionError:
        raise AssertionError(
            dev_cluster.kubectl("get", "pods,deploy,rs", "-n", ns, "-o", "wide").stdout
        ) from None
    for name, engine_roles in (("pd", ("prefill", "decode")), ("agg", ("engine",))):
        pool = dev_cluster.admin.get(POOLS.format(ns=ns) + f"/{name}")
        chosen = selected(dev_cluster, ns, pool["spec"]["selector"]["matchLabels"])
        assert chosen == set().union(*(pods[(name, role)] for role in engine_roles))
        assert not chosen & pods[(name, "router")]
    roles = {
        p["metadata"]["name"]: p["metadata"]["labels"].get("llm-d.ai/role") for p in dev_cluster.pods(ns)
    }
    for (name, role), names in pods.items():
        expected = {"prefill": "prefill", "decode": "decode", "engine": "prefill-decode", "router": None}[
            role
        ]
        assert {roles[n] for n in names} == {expected}, (name, role)
