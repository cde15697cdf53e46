"""The CRD on a real kube-apiserver: bad resources are refused naming the field, nothing is
created for them, and the server's defaults equal the models' defaults."""

from __future__ import annotations

import json
from typing import Any

import pytest

from baton_operator import crd, models
from baton_operator.builders import BuildContext, Owner, desired_children
from baton_operator.builders.extras import new_signing_key
from baton_operator.kube import FIELD_MANAGER, path_of
from baton_operator.models import InferenceDeploymentSpec
from baton_support.apiserver import ApiServer, Rest
from tests.operator_tests.cases import (
    AT_THE_LIMITS,
    CHILD_REFUSED_CASES,
    NAME_CASES,
    SPEC_CASES,
    VALID_SPEC,
    Case,
    merged,
)

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


def test_the_child_refusals_are_refused_by_the_crd_in_numbers(kube: Any) -> None:
    assert len(CHILD_REFUSED_CASES) >= 20


@pytest.mark.parametrize("name", sorted(AT_THE_LIMITS))
def test_specs_at_the_limits_are_accepted_and_so_are_their_children(
    apiserver: ApiServer, kube: Any, name: str
) -> None:
    """What the CRD accepts at its limits, the API server accepts in every child object (each
    applied server-side with dryRun=All, as the operator would apply it)."""
    spec = merged(VALID_SPEC, AT_THE_LIMITS[name])
    created = _create(kube, NS_GOOD, f"limits-{name}", spec)
    rest = Rest(apiserver)
    owner = Owner(name=created["metadata"]["name"], namespace=NS_GOOD, uid=created["metadata"]["uid"])
    ctx = BuildContext(owner, InferenceDeploymentSpec.model_validate(created["spec"]))
    children = desired_children(ctx, new_signing_key())
    manifests = [*children.created_once, *children.applied]
    assert len(manifests) == 14
    refused = {}
    for manifest in manifests:
        status, body = rest.call(
            "PATCH",
            path_of(manifest) + f"?fieldManager={FIELD_MANAGER}&force=true&dryRun=All",
            manifest,
            "application/apply-patch+yaml",
        )
        if status not in (200, 201):
            refused[f"{manifest['kind']} {manifest['metadata']['name']}"] = body.get("message")
    assert refused == {}


def _numbers_as_floats(node: Any) -> Any:
    """JSON numbers compared by value (the API server stores 1.0 as 1)."""
    if isinstance(node, dict):
        return {k: _numbers_as_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers_as_floats(v) for v in node]
    if isinstance(node, int | float) and not isinstance(node, bool):
        return float(node)
    return node


def test_the_api_server_stores_the_schema_as_generated(kube: Any) -> None:
    """Nothing of the generated schema is dropped on the way in (a keyword CRDs do not know,
    such as `const`, would be pruned silently, and a server-side apply of the file would then
    conflict with the stored copy)."""
    import kubernetes

    ext = kubernetes.client.ApiextensionsV1Api(kube)
    stored = ext.api_client.sanitize_for_serialization(
        ext.read_custom_resource_definition(crd.crd()["metadata"]["name"])
    )
    generated = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _numbers_as_floats(
        stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    ) == _numbers_as_floats(generated)
