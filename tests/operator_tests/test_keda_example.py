"""examples/keda/: the InferenceDeployment in external mode and KEDA ScaledObjects for it, applied
to a real API server that has the ScaledObject CRD of a KEDA release (read from its Go module):
accepted under strict field validation, aimed at the Deployments the operator makes (whose
replicas it leaves alone), on vLLM metric names Baton's engines export."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_dev import ecosystem_crds
from baton_engine import contract
from baton_operator.kube import FIELD_MANAGER, Kube
from baton_operator.reconcile import OperatorConfig, reconcile
from baton_support.apiserver import ApiServer, Rest
from baton_support.operator_process import CLUSTER_PATHS, wait_established
from baton_support.wait import wait_for

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "keda"
CRD = ecosystem_crds.KEDA_SCALED_OBJECT
STRICT = "?fieldValidation=Strict"


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLE / name).read_text()) if d]


@pytest.fixture(scope="module")
def keda_crd(apiserver: ApiServer, kube: Any) -> Iterator[None]:
    try:
        crd = ecosystem_crds.load(CRD)
    except ecosystem_crds.ModuleUnavailable as exc:
        pytest.skip(f"KEDA's Go module is not available: {exc}")
    rest = Rest(apiserver)
    path = f"{CLUSTER_PATHS['CustomResourceDefinition']}/{CRD.name}"
    status, answer = rest.call("POST", CLUSTER_PATHS["CustomResourceDefinition"], crd)
    assert status == 201, answer
    try:
        wait_established(rest, CRD.name)
        yield
    finally:
        rest.call("DELETE", path)
        wait_for(
            lambda: rest.call("GET", path)[0] == 404,
            timeout=60,
            interval=0.1,
            message="the ScaledObject CRD to be deleted",
        )


@pytest.fixture
def example_namespace(apiserver: ApiServer, kube: Any) -> str:
    """The namespace the example names (its queries name it too), created unless it exists (the
    bare API server has no namespace controller to delete one)."""
    (infd,) = load("smollm2-external.yaml")
    name: str = infd["metadata"]["namespace"]
    status, answer = Rest(apiserver).call("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert status in (201, 409), answer
    return name


def queried_metrics(query: str) -> set[str]:
    return set(re.findall(r"(vllm:[a-z_]+)\{", query))


def pod_pattern(query: str) -> str:
    (pattern,) = re.findall(r'pod=~"([^"]+)"', query)
    return pattern


async def test_scaled_objects_drive_the_operators_deployments(
    keda_crd: None, akube: Kube, apiserver: ApiServer, example_namespace: str
) -> None:
    rest = Rest(apiserver)
    ns = example_namespace
    (infd,) = load("smollm2-external.yaml")
    assert infd["spec"]["autoscaling"]["mode"] == "external"
    status, body = rest.call(
        "POST", f"/apis/baton.dev/v1alpha1/namespaces/{ns}/inferencedeployments{STRICT}", infd
    )
    assert status == 201, body
    await reconcile(akube, body, OperatorConfig())
    deployments = {
        d["metadata"]["name"]: d for d in rest.get(f"/apis/apps/v1/namespaces/{ns}/deployments")["items"]
    }
    scaled = load("scaledobjects.yaml")
    targets = {}
    for obj in scaled:
        status, answer = rest.call(
            "POST", f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects{STRICT}", obj
        )
        assert status == 201, answer
        ref = obj["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        target = deployments[ref["name"]]
        role = target["spec"]["selector"]["matchLabels"][contract.LABEL_ROLE]
        targets[role] = obj
        # External mode: the operator's apply leaves replicas to the HPA that KEDA makes.
        ours = [m for m in target["metadata"]["managedFields"] if m["manager"] == FIELD_MANAGER]
        assert ours and all("f:replicas" not in m["fieldsV1"].get("f:spec", {}) for m in ours)
    assert sorted(targets) == ["decode", "prefill"]

    vllm_names = set(contract.VLLM_EQUIVALENT.values())
    wanted = {"prefill": "vllm:num_requests_waiting", "decode": "vllm:kv_cache_usage_perc"}
    for role, obj in targets.items():
        (trigger,) = obj["spec"]["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        query = trigger["metadata"]["query"]
        assert queried_metrics(query) == {wanted[role]} and wanted[role] in vllm_names
        assert f'namespace="{ns}"' in query
        # The pod regex matches this role's pods (Deployment-ReplicaSet-hash names) and no other.
        pattern = re.compile(pod_pattern(query))
        for other in ("prefill", "decode", "router"):
            pod = f"{infd['metadata']['name']}-{other}-7d9f8c6b5-x2x7z"
            assert bool(pattern.fullmatch(pod)) == (other == role), (role, pod)


async def test_the_keda_crd_refuses_min_above_max(
    keda_crd: None, apiserver: ApiServer, example_namespace: str
) -> None:
    rest = Rest(apiserver)
    bad = load("scaledobjects.yaml")[0]
    bad["spec"]["minReplicaCount"] = 5
    status, answer = rest.call(
        "POST", f"/apis/keda.sh/v1alpha1/namespaces/{example_namespace}/scaledobjects{STRICT}", bad
    )
    assert status == 422
    assert "minReplicaCount must be less than or equal to maxReplicaCount" in answer["message"]
