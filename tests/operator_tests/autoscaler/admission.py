"""ValidatingAdmissionPolicies that make a real API server refuse chosen writes, for tests of
how the operator copes with a refused write."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from baton_support.apiserver import Rest
from baton_support.wait import wait_for

ADMISSION = "/apis/admissionregistration.k8s.io/v1"


@dataclass(frozen=True)
class Refusal:
    """UPDATEs of `resource` (``plural`` or ``plural/subresource``) of the object `object_name`
    are refused with `message` unless the CEL expression `allowed` holds for the new object."""

    name: str
    api_group: str
    resource: str
    object_name: str
    allowed: str
    message: str
    #: A dry-run merge patch of `probe` to `probe_path` is refused once the policy is in force.
    probe_path: str
    probe: dict[str, Any]


def replicas_cap(deployment_path: str, deployment: str, most: int) -> Refusal:
    return Refusal(
        f"cap-{deployment}",
        "apps",
        "deployments",
        deployment,
        f"object.spec.replicas <= {most}",
        f"at most {most} replicas",
        deployment_path,
        {"spec": {"replicas": most + 1}},
    )


@contextmanager
def refused(rest: Rest, refusal: Refusal) -> Iterator[None]:
    """The API server enforces `refusal` inside the block (policies take effect asynchronously:
        it is entered once the probe is refused); the policy is deleted after, and left once the probe
    passes again."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": refusal.name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [refusal.api_group],
                        "apiVersions": ["*"],
                        "operations": ["UPDATE"],
                        "resources": [refusal.resource],
                    }
                ]
            },
            "matchConditions": [
                {"name": "this-one", "expression": f"object.metadata.name == '{refusal.object_name}'"}
            ],
            "validations": [{"expression": refusal.allowed, "message": refusal.message}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": refusal.name},
        "spec": {"policyName": refusal.name, "validationActions": ["Deny"]},
    }
    made: list[str] = []

    def probe() -> int:
        status, _ = rest.call(
            "PATCH", refusal.probe_path + "?dryRun=All", refusal.probe, "application/merge-patch+json"
        )
        return status

    try:
        for plural, body in (
            ("validatingadmissionpolicies", policy),
            ("validatingadmissionpolicybindings", binding),
        ):
            status, answer = rest.call("POST", f"{ADMISSION}/{plural}", body)
            assert status == 201, answer
            made.append(f"{ADMISSION}/{plural}/{refusal.name}")

        wait_for(
            lambda: probe() == 422,
            timeout=30,
            interval=0.1,
            message=f"the API server to enforce {refusal.name}",
        )
        yield
    finally:
        for path in reversed(made):
            status, answer = rest.call("DELETE", path)
            assert status == 200, answer
        if made:
            wait_for(
                lambda: probe() == 200,
                timeout=30,
                interval=0.1,
                message=f"the API server to drop {refusal.name}",
            )
