"""Every example is accepted by a real API server (strict field validation) and reconciles into
its children; the placement overlay a demo uses reaches every pod template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_operator import models
from baton_operator.kube import collection_path
from baton_operator.reconcile import OperatorConfig, reconcile
from baton_support.apiserver import ApiServer, Rest
from tests.operator_tests.kube_helpers import async_kube, create_namespace
from tests.operator_tests.placement import with_placement

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
PROCESS_NODES = {"baton.dev/node-type": "process"}


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def test_the_examples() -> None:
    assert [p.name for p in EXAMPLES] == ["full.yaml", "minimal.yaml", "smollm2-pd.yaml"]
    for path in EXAMPLES:
        doc = load(path)
        assert (doc["apiVersion"], doc["kind"]) == (models.API_VERSION, models.KIND)
        models.InferenceDeploymentSpec.model_validate(doc["spec"])


def test_placement_overlay_covers_every_pool() -> None:
    doc = with_placement(
        load(REPO / "examples/full.yaml"), PROCESS_NODES, [{"key": "t", "operator": "Exists"}]
    )
    spec = doc["spec"]
    assert spec["prefill"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "mi300x", **PROCESS_NODES}
    assert spec["router"]["nodeSelector"] == PROCESS_NODES
    assert spec["decode"]["tolerations"][-1] == {"key": "t", "operator": "Exists"}
    assert "pool" not in spec
    aggregated = with_placement({"spec": {"mode": "aggregated"}}, PROCESS_NODES)
    assert sorted(aggregated["spec"]) == ["mode", "pool", "router"]


@pytest.mark.k8s
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
async def test_example_is_accepted_and_reconciles(apiserver: ApiServer, kube: Any, path: Path) -> None:
    namespace = f"example-{path.stem}"
    create_namespace(kube, namespace)
    doc = with_placement(load(path), PROCESS_NODES) if path.stem == "smollm2-pd" else load(path)
    rest = Rest(apiserver)
    infds = f"/apis/{models.API_VERSION}/namespaces/{namespace}/{models.PLURAL}?fieldValidation=Strict"
    status, body = rest.call("POST", infds, doc)
    assert status == 201, body
    akube = async_kube(apiserver)
    try:
        await reconcile(akube, body, OperatorConfig())
    finally:
        await akube.close()
    deployments = {
        d["metadata"]["name"]: d
        for d in rest.get(collection_path("apps/v1", "Deployment", namespace))["items"]
    }
    name = doc["metadata"]["name"]
    assert sorted(deployments) == sorted(f"{name}-{role}" for role in ("prefill", "decode", "router"))
    if path.stem == "smollm2-pd":
        for deployment in deployments.values():
            assert deployment["spec"]["template"]["spec"]["nodeSelector"] == PROCESS_NODES
        engine = deployments["smollm2-pd-decode"]["spec"]["template"]["spec"]["containers"][0]
        assert engine["args"][engine["args"].index("--device") + 1] == "cpu"
        assert engine["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
