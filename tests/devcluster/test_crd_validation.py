"""A CRD with a structural schema and a CEL rule: the API server rejects bad objects on
`kubectl apply`, naming the field."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from baton_dev.testing import DevCluster
from baton_support.wait import wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture
def widget_crd(dev_cluster: DevCluster) -> Iterator[str]:
    group = f"t{uuid.uuid4().hex[:8]}.baton.dev"
    name = f"widgets.{group}"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "group": group,
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["minReplicas", "maxReplicas"],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "maximum": 100},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": "minReplicas must not exceed maxReplicas",
                                            "fieldPath": ".minReplicas",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    dev_cluster.apply(crd)
    wait_for(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in dev_cluster.admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            .get("status", {})
            .get("conditions")
            or []
        ),
        timeout=30,
        interval=0.1,
        message="the CRD to be established",
    )
    yield group
    dev_cluster.kubectl("delete", "crd", name, "--wait=false")


def _widget(group: str, lo: object, hi: object) -> str:
    return (
        f"apiVersion: {group}/v1\nkind: Widget\nmetadata: {{name: w1}}\n"
        f"spec: {{minReplicas: {lo}, maxReplicas: {hi}}}\n"
    )


def test_valid_object_is_accepted(dev_cluster: DevCluster, widget_crd: str, k8s_namespace: str) -> None:
    result = dev_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", stdin=_widget(widget_crd, 1, 3))
    assert result.stdout.strip() == f"widget.{widget_crd}/w1 created"


def test_cel_rule_rejects_min_above_max(dev_cluster: DevCluster, widget_crd: str, k8s_namespace: str) -> None:
    result = dev_cluster.kubectl(
        "apply", "-n", k8s_namespace, "-f", "-", stdin=_widget(widget_crd, 5, 2), check=False
    )
    assert result.returncode == 1
    assert result.stderr == (
        'The Widget "w1" is invalid: spec.minReplicas: Invalid value: '
        "minReplicas must not exceed maxReplicas\n"
    )
    assert not dev_cluster.exists(f"/apis/{widget_crd}/v1/namespaces/{k8s_namespace}/widgets/w1")


def test_schema_rejects_wrong_type_and_range(
    dev_cluster: DevCluster, widget_crd: str, k8s_namespace: str
) -> None:
    result = dev_cluster.kubectl(
        "apply", "-n", k8s_namespace, "-f", "-", stdin=_widget(widget_crd, '"two"', 500), check=False
    )
    assert result.returncode == 1
    assert 'spec.minReplicas: Invalid value: "string": spec.minReplicas in body must be of type integer' in (
        result.stderr
    )
    assert (
        "spec.maxReplicas: Invalid value: 500: spec.maxReplicas in body should be less than or equal to 100"
        in (result.stderr)
    )
