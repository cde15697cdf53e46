"""The CRD on a real kube-apiserver: bad resources are refused naming the field, nothing is
created for them, and the server's defaults equal the models' defaults."""

from __future__ import annotations

import json
from typing import Any

import pytest

from baton_operator import models
from baton_operator.models import InferenceDeploymentSpec
from tests.operator_tests.cases import NAME_CASES, SPEC_CASES, VALID_SPEC, Case

pytestmark = pytest.mark.k8s

NS_BAD = "default"
NS_GOOD = "kube-public"


def _create(kube: Any, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    import kubernetes

    body = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": name}, "spec": spec}
    api = kubernetes.client.CustomObjectsApi(kube)
    result: dict[str, Any] = api.create_namespaced_custom_object(
        models.GROUP, models.VERSION, namespace, models.PLURAL, body, field_validation="Strict"
    )
    return result


def _refusal(kube: Any, case: Case) -> dict[str, Any]:
    import kubernetes

    with pytest.raises(kubernetes.client.ApiException) as err:
        _create(kube, NS_BAD, case.name, case.spec())
    # 422: schema or CEL refusal; 400: strict decoding refused an unknown field.
    assert err.value.status in (400, 422), err.value.body
    status: dict[str, Any] = json.loads(err.value.body)
    return status


@pytest.mark.parametrize("case", SPEC_CASES + NAME_CASES, ids=lambda c: c.id)
def test_api_server_refuses_naming_the_field(kube: Any, case: Case) -> None:
    status = _refusal(kube, case)
    causes = status.get("details", {}).get("causes", []) or [{"message": status["message"]}]
    matching = [
        c for c in causes if (c.get("field") == case.field or case.field in c.get("message", ""))
        and case.detail in c.get("message", "")
    ]  # fmt: skip
    assert matching, f"no cause names {case.field} with {case.detail!r}: {causes}"


def test_at_least_twenty_refusals_and_nothing_created(kube: Any) -> None:
    import kubernetes

    assert len(SPEC_CASES) + len(NAME_CASES) >= 20
    for case in SPEC_CASES + NAME_CASES:
        _refusal(kube, case)
    api = kubernetes.client.CustomObjectsApi(kube)
    listed = api.list_namespaced_custom_object(models.GROUP, models.VERSION, NS_BAD, models.PLURAL)
    assert listed["items"] == []


def test_server_defaults_equal_model_defaults(kube: Any) -> None:
    created = _create(kube, NS_GOOD, "defaults", VALID_SPEC)
    stored = created["spec"]
    parsed = InferenceDeploymentSpec.model_validate(stored)
    assert parsed.model_dump(by_alias=True, exclude_none=True) == stored
    assert parsed == InferenceDeploymentSpec.model_validate(VALID_SPEC)


def test_mode_is_immutable(kube: Any) -> None:
    import kubernetes

    _create(kube, NS_GOOD, "immutable", {**VALID_SPEC, "mode": "aggregated"})
    api = kubernetes.client.CustomObjectsApi(kube)
    with pytest.raises(kubernetes.client.ApiException) as err:
        api.patch_namespaced_custom_object(
            models.GROUP,
            models.VERSION,
            NS_GOOD,
            models.PLURAL,
            "immutable",
            {"spec": {"mode": "disaggregated"}},
        )
    assert err.value.status == 422
    causes = json.loads(err.value.body)["details"]["causes"]
    assert any(c["field"] == "spec.mode" and "spec.mode is immutable" in c["message"] for c in causes), causes
